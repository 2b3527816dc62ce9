"""Screenshots of a Store's HTML view in a real browser (headless Chromium), and a check of
the styles the browser computed for it.

Pages: ``plain`` (the view alone on a bare page), ``lab`` and ``lab-dark`` (inside nbconvert's
JupyterLab HTML export of a notebook, light and dark theme: JupyterLab's stylesheet right-aligns
and zebra-stripes table cells), ``vscode-dark`` (a bare page with VS Code's dark colours).

    python docs/make_screenshots.py                # PNGs and pages in build/screenshots/
    python docs/make_screenshots.py --docs         # also docs/store-view.png, shown by the README

Needs Chromium (Debian: ``apt-get install chromium``) and nbconvert. ``check_styles`` is what
tests/test_display.py asserts on (skipped where Chromium is missing).
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS_PNG = ROOT / "docs" / "store-view.png"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
PAGES = ("plain", "lab", "lab-dark", "vscode-dark")

# Written into each page: what the browser computed for the view, read back with --dump-dom.
_PROBE = """<script>
window.addEventListener('load', () => {
  const view = document.querySelector('.th5');
  const st = (el) => getComputedStyle(el);
  const table = [...view.querySelectorAll('table.t')].find((t) => t.offsetParent && t.rows.length >= 3);
  const textLeft = (el) => { const r = document.createRange(); r.selectNodeContents(el);
                             return Math.round(r.getBoundingClientRect().left); };
  const out = {
    host_color: st(view.parentElement).color, view_color: st(view).color,
    page_background: st(document.body).backgroundColor,
    rows: [...table.rows].slice(0, 2).map((tr) => ({background: st(tr).backgroundColor,
      cells: [...tr.cells].map((td) => ({text: td.textContent, align: st(td).textAlign, color: st(td).color,
                                         padding: st(td).padding}))})),
    name_text_lefts: [...table.rows].map((tr) => textLeft(tr.cells[0])),
    table_margin_left: st(table).marginLeft,
  };
  const pre = document.createElement('pre');
  pre.id = 'th5-probe';
  pre.hidden = true;
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def browser() -> str | None:
    """The path of a Chromium-like browser, or None."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def sample_html(workdir: Path) -> tuple[str, str]:
    """(code, HTML) of the view of a small synthetic training checkpoint (model, optimizer, config)."""
    import tensorstore_h5 as th5
    from tensorstore_h5.bench.synthetic import checkpoint

    path = workdir / "ckpt.h5"
    th5.save(checkpoint(layers=2, width=64), path, metadata={"run": "screenshots"})
    with th5.open(path) as store:
        return "th5.open('ckpt.h5')", store._repr_html_().replace(str(path), "ckpt.h5")


def _bare_page(view: str, dark: bool) -> str:
    # VS Code's notebook webview sets these variables and colours; a bare page sets nothing.
    style = ("body{background:#1f1f1f;color:#cccccc;font-family:system-ui;--vscode-editor-font-family:monospace}"
             if dark else "")
    return f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head><body>{view}</body></html>"


def _lab_page(code: str, view: str, theme: str) -> str:
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = nbformat.v4.new_code_cell(code, execution_count=1)
    cell.outputs = [nbformat.v4.new_output("execute_result", {"text/html": view, "text/plain": "<Store>"},
                                           execution_count=1)]
    nb.cells = [cell]
    body, _ = HTMLExporter(template_name="lab", theme=theme).from_notebook_node(nb)
    return body


def pages(workdir: Path) -> dict[str, str]:
    """HTML of each page in :data:`PAGES`, with the probe script."""
    code, view = sample_html(workdir)
    out = {"plain": _bare_page(view, dark=False), "lab": _lab_page(code, view, "light"),
           "lab-dark": _lab_page(code, view, "dark"), "vscode-dark": _bare_page(view, dark=True)}
    return {name: page.replace("</body>", _PROBE + "</body>", 1) for name, page in out.items()}


def _run(args: list[str]) -> str:
    exe = browser()
    if exe is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
               "--hide-scrollbars", "--force-device-scale-factor=1", f"--user-data-dir={profile}", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def screenshot(page: Path, png: Path, size: tuple[int, int]) -> Path:
    """Render ``page`` in a ``size`` window into ``png``."""
    _run([f"--screenshot={png}", f"--window-size={size[0]},{size[1]}", page.as_uri()])
    if not png.exists():
        raise RuntimeError(f"Chromium wrote no {png}")
    return png


def check_styles(page: Path) -> dict:
    """What the browser computed for the view in ``page`` (see ``_PROBE``)."""
    dom = _run(["--dump-dom", "--virtual-time-budget=2000", page.as_uri()])
    found = re.search(r'<pre id="th5-probe"[^>]*>(.*?)</pre>', dom, re.S)
    if found is None:
        raise RuntimeError(f"no probe result in the DOM of {page}")
    return json.loads(html.unescape(found.group(1)))


def _shrink(png: Path) -> None:
    """Rewrite ``png`` with a 64-colour palette (a third of the size, the same to the eye)."""
    from PIL import Image

    with Image.open(png) as im:
        small = im.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    small.save(png, optimize=True)


def make(out: Path, docs: bool = False, size: tuple[int, int] = (900, 760)) -> dict[str, Path]:
    """Write each page and its screenshot into ``out``; with ``docs``, also :data:`DOCS_PNG`."""
    out.mkdir(parents=True, exist_ok=True)
    made = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in pages(Path(tmp)).items():
            page = out / f"{name}.html"
            page.write_text(text, encoding="utf-8")
            made[name] = screenshot(page, out / f"{name}.png", size)
        if docs:
            screenshot(out / "lab.html", DOCS_PNG, (720, 680))
            _shrink(DOCS_PNG)
            made["docs"] = DOCS_PNG
    return made


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "screenshots")
    ap.add_argument("--docs", action="store_true", help=f"also write {DOCS_PNG.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    for name, png in make(args.out, args.docs).items():
        print(f"{name:12} {os.path.relpath(png)}")
        if name in PAGES:
            print(f"{'':12} {json.dumps(check_styles(args.out / f'{name}.html'))}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
