from __future__ import annotations

import torch

import tensorstore_h5 as th5


def test_store_and_handle_html(tmp_path) -> None:
    th5.save({"model": {"w<b>": torch.zeros(3, 300), "t": torch.zeros(4, 2).t()}, "epoch": 3}, tmp_path / "f.h5")
    with th5.open(tmp_path / "f.h5") as s:
        html = s._repr_html_()
        assert "<details open><summary>model/" in html and "w&lt;b&gt;" in html and "float32 [3, 300]" in html
        assert "stride [1, 2]" in html and "int = 3" in html
        assert "float32 [3, 300]" in s["model/w<b>"]._repr_html_()


def test_html_of_a_10000_key_file_is_collapsed_and_reads_no_data(tmp_path, monkeypatch) -> None:
    th5.save({"layers": {f"p{i}": torch.zeros(2) for i in range(10_000)}}, tmp_path / "big.h5")
    with th5.open(tmp_path / "big.h5") as s:
        monkeypatch.setattr(th5.Store, "_read_tensor", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read")))
        html = s._repr_html_()
    assert "<details><summary>layers/" in html and "9800 more" in html and html.count("<tr>") == 201


def test_html_shows_compression_ratio(tmp_path) -> None:
    t = torch.zeros(512, 64)
    th5.save({"w": t, "plain": t.clone()}, tmp_path / "c.h5", compression=lambda k, _t: "lz4" if k == "w" else None)
    with th5.open(tmp_path / "c.h5") as s:
        html = s._repr_html_()
    row_w = html.split("<td>w</td>")[1].split("</tr>")[0]
    row_plain = html.split("<td>plain</td>")[1].split("</tr>")[0]
    assert "compressed to 0.0" in row_w and "compressed" not in row_plain


def test_progress_bars_by_bytes(tmp_path, capsys) -> None:
    sd = {f"w{i}": torch.zeros(256, 256) for i in range(4)}
    th5.save(sd, tmp_path / "p.h5", progress=True)
    th5.load(tmp_path / "p.h5", progress=True)
    th5.load_into({k: torch.empty_like(v) for k, v in sd.items()}, tmp_path / "p.h5", progress=True)
    err = capsys.readouterr().err
    assert "saving p.h5" in err and "loading p.h5" in err and "1.00M" in err  # 4 x 256 KiB, counted in bytes
    th5.save(sd, tmp_path / "q.h5", progress=False)
    th5.load(tmp_path / "q.h5")  # small and not interactive: no bar
    assert capsys.readouterr().err == ""
