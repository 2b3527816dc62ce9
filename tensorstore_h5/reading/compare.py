"""Comparing checkpoints and summarising their tensors, streaming: :func:`diff` (two checkpoints,
key by key) and :func:`stats` (one checkpoint, tensor by tensor).

Both read through the stores' own reads (``handle.read(index=...)``: the I/O threads, checksums
as a read checks them) on one thread per store, ahead of the arithmetic, which runs in float64
on cache-sized chunks. A tensor larger than :data:`BLOCK_BYTES` is read in blocks of rows, and
at most :data:`AHEAD_BYTES` are read ahead of the block being compared, so memory stays at a few
blocks whatever the size of the checkpoints.

``th5.diff`` and ``th5.stats`` open paths as ``th5.open`` does (files, URLs, checkpoint
directories, Hugging Face shards); here, paths open with the ``opener`` given, except a lone
``.safetensors`` file, which is read through the ``safetensors`` package. Nothing here imports
the store classes: a store is anything with ``keys``, ``selected_keys``, ``path`` and
``[key]`` (a handle with ``shape``, ``dtype``, ``nbytes`` and ``read(index=, verify=)``, or a
plain value), so that the stores themselves can offer ``store.stats()``.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import display
from ..display import views
from ..errors import FormatError, KeyNotFoundError, TensorStoreError
from ..format import tree
from ..format.constants import KEY_PATHS, KEYS_MARKER
from ..format.dtypes import bits_view, spec_for_numpy
from .select import Selector, resolve

__all__ = ["diff", "stats", "Diff", "Stats", "STATUSES", "BLOCK_BYTES", "AHEAD_BYTES", "CHUNK_ELEMENTS",
           "COMPUTE_THREADS"]

BLOCK_BYTES = 32 * 2**20
"""A tensor larger than this is read and compared in blocks of rows of about this size."""

AHEAD_BYTES = 32 * 2**20
"""Bytes of each store read ahead of the block being compared (at least one block or tensor)."""

CHUNK_ELEMENTS = 32767
"""Elements converted to float64 at a time (256 KiB: the arithmetic stays in the CPU's cache).
Below torch's grain size (32,768), so that each op runs on the thread that calls it and
:data:`COMPUTE_THREADS` chunks run at once: torch's own threads split every op of a larger chunk
and wait for each other at its end, which on a busy machine took 4x as long (measured on 2 shared
cores: 50 against 220 million elements a second)."""

STATUSES = ("equal", "changed", "dtype", "shape", "only_a", "only_b")
"""A diff row's ``status``: bitwise equal; values differ; dtypes (or tensor against plain value)
differ; shapes differ; the key is only in ``a``; only in ``b``."""

_MISSING = object()


# ---------------------------------------------------------------------------- sources


class _Loaded:
    """An array or tensor already in memory, read like a handle."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t
        self.shape, self.dtype, self.nbytes = t.shape, t.dtype, t.numel() * t.element_size()

    def read(self, out: Any = None, *, index: Any = None, verify: bool | None = None) -> torch.Tensor:
        return self._t if index is None or index is Ellipsis else self._t[index].contiguous()


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}


class _SafetensorsHandle:
    def __init__(self, file: _SafetensorsFile, name: str) -> None:
        self._file, self._name = file, name
        sl = file._f.get_slice(name)
        dtype = _ST_DTYPES.get(sl.get_dtype())
        if dtype is None:
            raise FormatError(f"{file.path}: key {name!r}: safetensors dtype {sl.get_dtype()!r} is not supported")
        self.shape, self.dtype = torch.Size(sl.get_shape()), dtype
        self.nbytes = math.prod(self.shape) * dtype.itemsize

    def read(self, out: Any = None, *, index: Any = None, verify: bool | None = None) -> torch.Tensor:
        if index is None or index is Ellipsis or not self.shape:
            return self._file._f.get_tensor(self._name)
        index = index if isinstance(index, tuple) else (index,)
        return self._file._f.get_slice(self._name)[tuple(slice(i, i + 1) if isinstance(i, int) else i for i in index)]


class _SafetensorsFile:
    """A lone ``.safetensors`` file as a store, read through ``safetensors.safe_open``: its own
    checks, and reads from its mapping of the file (whose pages count in the process's RSS).
    Keys are the escaped tensor names, as a Hugging Face directory's, or, in a file that
    ``convert`` marked so (:data:`KEYS_MARKER`), the names themselves: key paths, nesting kept."""

    def __init__(self, path: str) -> None:
        try:
            from safetensors import safe_open
        except ImportError:
            raise TensorStoreError(f"{path}: reading a .safetensors file needs the safetensors package "
                                   "(pip install safetensors)") from None
        self.path = path
        try:
            self._f = safe_open(path, framework="pt")
        except FileNotFoundError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise FormatError(f"{path}: not a readable safetensors file ({e})") from e
        self._containers: dict[str, None] = {}
        if (self._f.metadata() or {}).get(KEYS_MARKER) == KEY_PATHS:
            self._names = {}
            for name in self._f.keys():
                try:
                    parts = tree.split(name)
                    for part in parts or [""]:
                        tree.unescape(part)
                except ValueError as e:
                    raise FormatError(f"{path}: key {name!r} is not a tensorstore_h5 key path, as the file's "
                                      f"__metadata__ ({KEYS_MARKER!r}) says it is ({e})") from None
                self._names[name] = name
                self._containers.update(("/".join(parts[:i]), None) for i in range(1, len(parts)))
        else:
            self._names = {tree.escape(n): n for n in self._f.keys()}

    def keys(self) -> list[str]:
        return list(self._names)

    def selected_keys(self, select: Selector = None) -> list[str]:
        included = resolve(select, list(self._names), list(self._containers), self.path)
        return [k for k in self._names if k in included]

    def __getitem__(self, key: str) -> _SafetensorsHandle:
        if key not in self._names:
            raise KeyNotFoundError(f"{self.path}: no key {key!r}")
        return _SafetensorsHandle(self, self._names[key])

    def close(self) -> None:
        self._f = None


def _is_store(x: Any) -> bool:
    return all(hasattr(x, a) for a in ("keys", "selected_keys", "path", "__getitem__"))


def _source(x: Any, opener: Callable[[Any], Any] | None) -> tuple[Any, bool]:
    """``(store, owned)``: ``x`` itself when it is a store, else ``x`` opened (and owned)."""
    if _is_store(x):
        return x, False
    if isinstance(x, (str, os.PathLike)) and os.fspath(x).endswith(".safetensors") and os.path.isfile(x):
        return _SafetensorsFile(os.fspath(x)), True
    if opener is None:
        raise TypeError(f"{x!r} is not an open store; tensorstore_h5.diff and .stats open paths, URLs and "
                        "directories (or pass opener=)")
    return opener(x), True


def _is_handle(x: Any) -> bool:
    return hasattr(x, "read") and hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, torch.Tensor)


def _as_handle(x: Any) -> Any:
    """A handle for a stored tensor, a tensor or a numeric numpy array; otherwise the value itself."""
    if _is_handle(x):
        return x
    if isinstance(x, torch.Tensor):
        return _Loaded(x.detach().cpu())
    if isinstance(x, np.ndarray) and spec_for_numpy(x.dtype) is not None:
        return _Loaded(torch.from_numpy(np.ascontiguousarray(x).astype(x.dtype.newbyteorder("="), copy=False)))
    return x


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(x: Any) -> str | None:
    if x is _MISSING:
        return None
    if _is_handle(x):
        return f"{_dtype_name(x.dtype)} {list(x.shape)}"
    text = repr(x)
    return f"{type(x).__name__} = {text if len(text) <= 40 else text[:39] + '…'}"


# ---------------------------------------------------------------------------- reading ahead


class _Unit(NamedTuple):
    """What is read and compared at once: one tensor or one block of its rows."""

    row: int
    handles: tuple[Any, ...]
    index: Any
    nbytes: int
    last: bool


def _blocks(shape: Sequence[int], itemsize: int, limit: int) -> Iterator[Any]:
    """Indices of blocks of about ``limit`` bytes covering a row-major tensor in order: ``...``
    for one that fits; else slices of its first dimension, or (a row too large) integers of the
    leading dimensions and a slice of the first dimension whose rows fit."""
    total = math.prod(shape) * itemsize
    if total <= limit or not shape:
        yield Ellipsis
        return
    k = 0
    while math.prod(shape[k + 1:]) * itemsize > limit:
        k += 1
    step = max(1, limit // (math.prod(shape[k + 1:]) * itemsize))
    for outer in itertools.product(*(range(n) for n in shape[:k])):
        for start in range(0, shape[k], step):
            yield (*outer, slice(start, min(start + step, shape[k])))


def _read(handle: Any, index: Any, verify: bool | None) -> torch.Tensor:
    return handle.read(index=index, verify=verify)


def _streamed(units: Iterator[_Unit], sides: int, verify: bool | None, shared: bool = False
              ) -> Iterator[tuple[_Unit, list[torch.Tensor]]]:
    """Each unit with its tensors read, in order. Each store is read on a thread of its own
    (its reads use the I/O threads; ``shared``: one store on both sides, one thread), up to
    :data:`AHEAD_BYTES` of units ahead of the one the caller holds; an error of a read comes out
    with its unit, and the reads queued after it are dropped."""
    pools = [ThreadPoolExecutor(1, thread_name_prefix="th5-compare") for _ in range(1 if shared else sides)]
    pools *= sides if shared else 1
    pending: deque[tuple[_Unit, list[Future[torch.Tensor]]]] = deque()
    ahead = 0
    nxt = next(units, None)
    try:
        while True:
            while nxt is not None and (not pending or ahead + nxt.nbytes <= AHEAD_BYTES * sides):
                pending.append((nxt, [pool.submit(_read, h, nxt.index, verify) for pool, h in zip(pools, nxt.handles)]))
                ahead += nxt.nbytes
                nxt = next(units, None)
            if not pending:
                return
            unit, futures = pending.popleft()
            ahead -= unit.nbytes
            tensors = [f.result() for f in futures]
            del futures
            yield unit, tensors
            del tensors
    finally:
        for _, futures in pending:
            for f in futures:
                f.cancel()
        for pool in set(pools):
            pool.shutdown(wait=True)


# ---------------------------------------------------------------------------- arithmetic


_KINDS: dict[torch.dtype, str] = {}


def _kind(dtype: torch.dtype) -> str:
    """``"float"``, ``"complex"``, ``"int"``, ``"bool"``, or ``"bits"`` (no arithmetic: float4,
    sub-byte integers, bits types; compared bit by bit only)."""
    kind = _KINDS.get(dtype)
    if kind is None:
        if dtype == torch.bool:
            kind = "bool"
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # complex32 is "experimental" in torch
                    torch.zeros(16, dtype=torch.uint8).view(dtype).to(torch.complex128 if dtype.is_complex else torch.float64)
                kind = "complex" if dtype.is_complex else "float" if dtype.is_floating_point else "int"
            except (RuntimeError, TypeError):
                kind = "bits"
        _KINDS[dtype] = kind
    return kind


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 (complex128 for complex dtypes)."""
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` (1-D, contiguous) as integers of its element size; complex128 as pairs of int64."""
    b = bits_view(t)
    return b.view(torch.int64).view(-1, 2) if b.dtype == torch.complex128 else b


def _count_differing(x: torch.Tensor, y: torch.Tensor) -> int:
    ne = _bits(x) != _bits(y)
    return int((ne.any(1) if ne.dim() == 2 else ne).sum())


def _dot(v: torch.Tensor) -> float:
    return float(torch.vdot(v, v).real) if v.is_complex() else float(torch.dot(v, v))


def _sumsq(v: torch.Tensor, finite_only: bool = False) -> tuple[float, float]:
    """The sum of squares (of the magnitudes) of the float64 or complex128 vector ``v`` as
    ``(scale, q)``, the sum being ``scale**2 * q`` (as LAPACK's dnrm2: squares that would overflow
    are scaled); with ``finite_only``, of its finite elements only."""
    s = _dot(v)
    if math.isfinite(s):
        return 1.0, s
    finite = torch.isfinite(v)
    if not bool(finite.all()):
        if not finite_only:
            return 1.0, s  # a nan or inf element: the sum is not finite
        v = v[finite]
        s = _dot(v)
        if math.isfinite(s):
            return 1.0, s
    m = float(v.abs().max())  # finite elements whose squares overflow
    return m, _dot(v / m)


class _SumSq:
    """A running sum of squares, ``scale**2 * q``, merged from :func:`_sumsq` parts."""

    __slots__ = ("scale", "q")

    def __init__(self) -> None:
        self.scale, self.q = 1.0, 0.0

    def merge(self, part: tuple[float, float]) -> None:
        scale, q = part
        if scale > self.scale:
            self.q = self.q * (self.scale / scale) ** 2 + q
            self.scale = scale
        else:
            self.q += q * (scale / self.scale) ** 2

    def norm(self) -> float:
        return self.scale * math.sqrt(self.q) if self.q == self.q else math.nan


def _exact(t: torch.Tensor, i: int) -> int | float | bool:
    """Element ``i`` of the 1-D ``t`` as a Python number, exactly."""
    if t.dtype == torch.uint64:
        return int(t.view(torch.int64)[i]) % 2**64
    v = t[i]
    if t.dtype == torch.bool:
        return bool(v)
    return int(v) if not (t.is_floating_point() or t.is_complex()) else float(v.to(torch.float64))


def _max(current: Any, new: Any) -> Any:
    """The larger, where nan wins (a nan difference stays visible)."""
    if current is None:
        return new
    if isinstance(current, float) and math.isnan(current):
        return current
    if isinstance(new, float) and math.isnan(new):
        return new
    return max(current, new)


COMPUTE_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Threads that run the arithmetic of a block's chunks at once (each op of a chunk of
:data:`CHUNK_ELEMENTS` runs on its own thread: torch splits no op below 32,768 elements)."""


def _chunked(pool: ThreadPoolExecutor, fn: Callable[..., Any], *tensors: torch.Tensor) -> list[Any]:
    """``fn`` of each chunk of :data:`CHUNK_ELEMENTS` of the flattened ``tensors``, in order; on
    the ``pool``'s threads when there is more than one chunk."""
    flat = [t.reshape(-1) for t in tensors]
    n = flat[0].numel()
    starts = range(0, n, CHUNK_ELEMENTS)
    if len(starts) <= 1:
        return [fn(*flat)] if n else []
    return list(pool.map(lambda s: fn(*(t[s:s + CHUNK_ELEMENTS] for t in flat)), starts))


class _DiffAcc:
    """The numbers of one pair of tensors of one shape, block by block, from the parts of their
    chunks (combined in order, so the sums do not depend on the threads' timing)."""

    def __init__(self, da: torch.dtype, db: torch.dtype) -> None:
        self.same = da == db
        ka, kb = _kind(da), _kind(db)
        numeric = ("float", "complex", "int")
        # one dtype: ints exactly, floats and complex in float64; two numeric dtypes: float64
        self.mode = (ka if self.same else "mixed") if ka in numeric and kb in numeric else \
            ("bits" if self.same else None)
        self.changed: int | None = 0 if self.mode is not None else None
        self.max_abs: Any = None
        self.ssd, self.ssa = _SumSq(), _SumSq()

    def add(self, pool: ThreadPoolExecutor, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.mode is None:
            return
        for changed, max_abs, ssd, ssa in _chunked(pool, self._chunk, a, b):
            self.changed += changed  # type: ignore[operator]
            if max_abs is not None:
                self.max_abs = _max(self.max_abs, max_abs)
            if ssd is not None:
                self.ssd.merge(ssd)
            if ssa is not None:
                self.ssa.merge(ssa)

    def _chunk(self, x: torch.Tensor, y: torch.Tensor) -> tuple[int, Any, Any, Any]:
        """``(elements changed, max |y - x|, sum of squares of y - x, of x)`` of one chunk."""
        mode = self.mode
        if self.same and torch.equal(_bits(x), _bits(y)):
            if mode == "bits":
                return 0, None, None, None
            return 0, 0 if mode == "int" else 0.0, None, _sumsq(_wide(x), finite_only=True)
        if mode == "bits":
            return _count_differing(x, y), None, None, None
        if mode == "int":
            if x.element_size() < 8:
                d = y.to(torch.int64) - x.to(torch.int64)
                max_abs: Any = int(d.abs().max())
                dd = d.to(torch.float64)
            else:  # int64, uint64: the difference in float64 finds the element, Python ints give it exactly
                dd = y.to(torch.float64) - x.to(torch.float64)
                i = int(dd.abs().argmax())
                max_abs = abs(_exact(y, i) - _exact(x, i))  # type: ignore[operator]
            return _count_differing(x, y), max_abs, _sumsq(dd), _sumsq(x.to(torch.float64))
        xd, yd = _wide(x), _wide(y)
        d = yd - xd
        ssd = _sumsq(d)
        if not math.isfinite(ssd[1]):  # a nan or inf: the same inf, or nan in both, is no difference
            d.masked_fill_((xd == yd) | (torch.isnan(xd) & torch.isnan(yd)), 0)
            ssd = _sumsq(d)
        if d.is_complex():
            max_abs = float(d.abs().max())
        else:
            lo, hi = torch.aminmax(d)
            max_abs = float(torch.maximum(-lo, hi))  # nan if either is
        changed = _count_differing(x, y) if self.same else int(torch.count_nonzero(d))  # nan counts
        return changed, max_abs, ssd, _sumsq(xd, finite_only=True)

    def numbers(self) -> tuple[int | None, Any, float | None]:
        """``(changed, max_abs, rel_l2)``."""
        if self.mode in (None, "bits"):
            return self.changed, None, None
        nd, na = self.ssd.norm(), self.ssa.norm()
        rel = 0.0 if nd == 0 else math.inf if na == 0 and nd == nd else nd / na
        max_abs = self.max_abs if self.max_abs is not None else (0 if self.mode == "int" else 0.0)
        return self.changed, max_abs, rel


def _same_value(x: Any, y: Any) -> bool:
    """Plain values compared by equality (nan equal to nan; containers element by element)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    if isinstance(x, complex):
        return _same_value(x.real, y.real) and _same_value(x.imag, y.imag)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same_value(a, b) for a, b in zip(x, y))
    if isinstance(x, dict):
        return list(x) == list(y) and all(_same_value(x[k], y[k]) for k in x)
    if isinstance(x, np.ndarray):
        return x.dtype == y.dtype and x.shape == y.shape and \
            bool(np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - a value without a truth value of ==
        return False


# ---------------------------------------------------------------------------- diff


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.3g}" if math.isfinite(v) else str(v)
    return str(v)


def _table(headings: Sequence[str], lines: list[list[str]], right: set[int]) -> str:
    """Plain-text columns (the command line's output)."""
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(headings)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(headings)] + [fmt(line) for line in lines])


_NUMBERED = re.compile(r"(?:^|[/.])(\d+)(?=[/.]|$)")


def _runs(labels: Sequence[tuple[str, str]]) -> list[tuple[str, int, int]]:
    """``(label, start, stop)`` of each run of equal ``(group, label)`` pairs."""
    out: list[tuple[str, int, int]] = []
    last = None
    for i, (group, label) in enumerate(labels):
        if out and group == last:
            out[-1] = (out[-1][0], out[-1][1], i + 1)
        else:
            out.append((label, i, i + 1))
        last = group
    return out


def _figure(title: str, values: list[float | None], keys: Sequence[str]) -> str:
    """The view's figure: ``values`` per key, in order, in bands of the keys' first numbered
    block (``layers.3.``, labelled 3) and sections of their top container (``model/``). The
    title names the numbered prefix of most keys with a bar (of most keys if none has one)."""
    numbered, prefixes = [], {}
    for key, v in zip(keys, values):
        m = _NUMBERED.search(key)
        numbered.append((key[:m.end()] if m else "", m.group(1) if m else ""))
        if m:
            p = key[:m.start(1)]
            prefixes[p] = prefixes.get(p, 0) + 1 + len(keys) * bool(v)
    tops = [(k.partition("/")[0] + "/", k.partition("/")[0] + "/") if "/" in k else ("", "") for k in keys]
    sections = _runs(tops)
    if prefixes:
        title += f"; shaded: {max(prefixes, key=prefixes.__getitem__)}N"
    return views.bar_chart_svg(values, keys, _runs(numbered), sections if len(sections) > 1 else (), title=title + ")")


class _Rows(Sequence[dict]):  # type: ignore[type-arg]
    """A sequence of dict rows (``pandas.DataFrame(rows)`` makes a table of it)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self._rows = rows

    def __getitem__(self, i: Any) -> Any:
        return self._rows[i]

    def __len__(self) -> int:
        return len(self._rows)

    def __str__(self) -> str:
        return self.text()

    def text(self) -> str:
        raise NotImplementedError


class _DiffTotals:
    __slots__ = ("counts", "rel", "weight")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.rel: float | None = None
        self.weight = 0  # keys that differ: groups of those start open (tree_html)

    def add(self, row: _ViewRow) -> None:
        r = row.data
        self.counts[r["status"]] = self.counts.get(r["status"], 0) + 1
        self.weight += r["status"] != "equal"
        if r["rel_l2"] is not None:
            self.rel = _max(self.rel, r["rel_l2"])

    def text(self, keys: int) -> str:
        parts = ", ".join(f"{self.counts[s]:,} {s}" for s in STATUSES if s in self.counts)
        rel = f"; rel. change up to {_fmt(self.rel)}" if self.rel else ""
        return f"{keys:,} key{'s' * (keys != 1)}: {parts}{rel}"


class _ViewRow(NamedTuple):
    path: str
    data: dict[str, Any]


def _bar(v: float | None, lo: int, hi: int) -> views.Html:
    """A table cell's bar of ``v`` on the decades ``lo``..``hi`` (none for None and 0; full and
    red for nan and inf)."""
    if not v:
        return views.bar_svg(0)
    if not math.isfinite(v):
        return views.bar_svg(1, alert=True)
    return views.bar_svg(max(0.02, (math.log10(v) - lo) / (hi - lo)))


def _log_range(values: list[float]) -> tuple[int, int]:
    finite = [v for v in values if v and math.isfinite(v) and v > 0]
    if not finite:
        return -1, 0
    lo, hi = math.floor(math.log10(min(finite))), math.ceil(math.log10(max(finite)))
    return lo, max(hi, lo + 1)


class Diff(_Rows):
    """What :func:`diff` found: a sequence of rows, one per key, in the order of ``a`` (keys only in
    ``b`` after them). Each row is a dict:

    - ``key``; ``status``: one of :data:`STATUSES`;
    - ``a``, ``b``: what each side holds (``"float32 [768, 768]"``, ``"int = 3"``; None where absent);
    - ``changed``: elements that differ (bit by bit for one dtype, by value across dtypes);
    - ``max_abs``: the largest ``|b - a|`` (an int for integer tensors, a float otherwise);
    - ``rel_l2``: ``‖b - a‖₂ / ‖a‖₂``, summed in float64 (inf where ``a`` is all zeros and ``b`` is not);

    None where a number does not apply (plain values, bool and bit-typed tensors have ``changed``
    only, different shapes none). ``str(diff)`` is a text table of the keys that differ, and in
    Jupyter it shows as a tree of the keys with the relative change per key (a figure) above it."""

    def __init__(self, rows: list[dict[str, Any]], a: str, b: str) -> None:
        super().__init__(rows)
        self.a, self.b = a, b

    @property
    def equal(self) -> bool:
        """True when every key is in both and bitwise equal (what ``tensorstore-h5 diff`` exits 0 for)."""
        return all(r["status"] == "equal" for r in self._rows)

    def counts(self) -> dict[str, int]:
        """Keys per status (statuses that occur), in the order of :data:`STATUSES`."""
        found = {s: 0 for s in STATUSES}
        for r in self._rows:
            found[r["status"]] += 1
        return {s: n for s, n in found.items() if n}

    def summary(self) -> str:
        counts = ", ".join(f"{n:,} {s}" for s, n in self.counts().items()) or "no keys"
        return f"{self.a} -> {self.b}: {len(self):,} key{'s' * (len(self) != 1)}: {counts}"

    def text(self, all: bool = False) -> str:  # noqa: A002 - the command line's --all
        """A text table of the keys that differ (``all``: of every key), and the summary line."""
        rows = [r for r in self._rows if all or r["status"] != "equal"]
        lines = [[r["key"], r["status"], _fmt(r["max_abs"]), _fmt(r["rel_l2"]), _fmt(r["changed"]),
                  _side_text(r)] for r in rows]
        table = _table(["key", "status", "max |b-a|", "rel L2", "changed", "a -> b"], lines, {2, 3, 4}) + "\n" \
            if rows else ""
        return table + self.summary()

    def __repr__(self) -> str:
        return f"<tensorstore_h5.Diff {self.summary()}>"

    def _repr_html_(self) -> str:
        rels = [r["rel_l2"] for r in self._rows]
        lo, hi = _log_range([v for v in rels if v is not None])
        figure = _figure("relative change ‖b − a‖₂ / ‖a‖₂ per key, in order (log scale", rels,
                         [r["key"] for r in self._rows])

        def cells(row: _ViewRow) -> tuple[str, ...]:
            r = row.data
            rel = r["rel_l2"]
            return r["status"], _side_text(r), _fmt(r["max_abs"]), _fmt(rel), _fmt(r["changed"]), _bar(rel, lo, hi)

        columns = (views.Column("status"), views.Column("a → b", dim=True), views.Column("max |b−a|", "right"),
                   views.Column("rel L2", "right"), views.Column("changed", "right"), views.Column("rel L2 (log)"))
        return views.tree_html(repr(self), [_ViewRow(r["key"], r) for r in self._rows], cells=cells,
                                 totals=_DiffTotals, columns=columns, head=figure)


def _side_text(r: dict[str, Any]) -> str:
    a, b = r["a"], r["b"]
    if a is None or b is None:
        return a or b or ""
    return a if a == b else f"{a} → {b}"


def _selected_pair(sa: Any, sb: Any, select: Selector) -> tuple[list[str], list[str]]:
    """The keys of each store that ``select`` picks; an exact key need only be in one of them."""
    if select is None or callable(select):
        return sa.selected_keys(select), sb.selected_keys(select)
    patterns = [select] if isinstance(select, str) else list(select)
    picked: tuple[set[str], set[str]] = (set(), set())
    for p in patterns:
        errors = []
        for store, keys in zip((sa, sb), picked):
            try:
                keys.update(store.selected_keys([p]))
            except KeyNotFoundError as e:
                errors.append(e)
        if len(errors) == 2:
            raise KeyNotFoundError(f"{errors[0]}; nor in {sb.path}")
    return [k for k in sa.keys() if k in picked[0]], [k for k in sb.keys() if k in picked[1]]


def diff(a: Any, b: Any, select: Selector = None, *, progress: bool | None = None, verify: bool | None = None,
         opener: Callable[[Any], Any] | None = None) -> Diff:
    """Compare two checkpoints key by key, streaming: memory holds a few tensors (blocks of
    :data:`BLOCK_BYTES` of larger ones), never a checkpoint.

    Args:
        a, b: stores, or what ``opener`` opens (``th5.diff``: anything ``th5.open`` takes), or
            a lone ``.safetensors`` file.
        select: the keys to compare, as for ``load`` (a glob, a list of keys or globs, or a
            callable), applied to both; an exact key may be in one of them only.
        progress: a progress bar by bytes read (see :func:`tensorstore_h5.save`).
        verify: as for a read: by default (None) the checksums of every tensor read whole
            (each one up to :data:`BLOCK_BYTES`) are checked, blocks of larger ones are not;
            True checks those too (their checksum blocks, or a directory's pieces they
            overlap, one more pass each); False checks nothing.
        opener: opens an ``a`` or ``b`` that is not a store.

    Returns:
        :class:`Diff`: a sequence of rows (``key``, ``status``, ``max_abs``, ``rel_l2``, ...).
        Floats of every width (float8, bfloat16, float16, float32, float64) and complex numbers
        are compared in float64: ``max_abs`` is the largest ``|b - a|`` and ``rel_l2`` is
        ``‖b - a‖₂ / ‖a‖₂``, ``‖a‖₂`` over the finite elements of ``a``; elements equal in both
        (the same inf, nan in both) count as no difference, and any other nan or inf difference
        makes them nan or inf. Integers: ``max_abs`` an exact int, ``rel_l2`` in float64. Bool
        and bit-typed tensors: ``changed`` (elements that differ) only. Tensors of one shape
        and two numeric dtypes (float32 against bfloat16) have status ``"dtype"`` and their
        numbers too; plain values compare by equality.

    Raises:
        KeyNotFoundError: an exact key of ``select`` is in neither.
        FormatError, TensorStoreError: as the reads raise them.
    """
    sa, own_a = _source(a, opener)
    try:
        sb, own_b = _source(b, opener)
    except BaseException:
        if own_a:
            sa.close()
        raise
    try:
        return _diff(sa, sb, select, progress, verify)
    finally:
        if own_a:
            sa.close()
        if own_b:
            sb.close()


def _diff(sa: Any, sb: Any, select: Selector, progress: bool | None, verify: bool | None) -> Diff:
    keys_a, keys_b = _selected_pair(sa, sb, select)
    in_a, in_b = set(keys_a), set(keys_b)
    rows: list[dict[str, Any]] = []
    accs: dict[int, _DiffAcc] = {}
    work: list[tuple[int, Any, Any]] = []
    for key in keys_a + [k for k in keys_b if k not in in_a]:
        va = _as_handle(sa[key]) if key in in_a else _MISSING
        vb = _as_handle(sb[key]) if key in in_b else _MISSING
        row = {"key": key, "status": "", "a": _describe(va), "b": _describe(vb), "changed": None, "max_abs": None,
               "rel_l2": None}
        rows.append(row)
        if va is _MISSING or vb is _MISSING:
            row["status"] = "only_a" if vb is _MISSING else "only_b"
        elif _is_handle(va) != _is_handle(vb):
            row["status"] = "dtype"  # a tensor against a plain value
        elif not _is_handle(va):
            row["status"] = "equal" if _same_value(va, vb) else "changed"
        elif tuple(va.shape) != tuple(vb.shape):
            row["status"] = "shape"
        else:
            row["status"] = "equal" if va.dtype == vb.dtype else "dtype"
            accs[len(rows) - 1] = _DiffAcc(va.dtype, vb.dtype)
            work.append((len(rows) - 1, va, vb))

    def units() -> Iterator[_Unit]:
        for i, ha, hb in work:
            if accs[i].mode is None:  # two dtypes without arithmetic between them: nothing to read
                continue
            itemsize = max(ha.dtype.itemsize, hb.dtype.itemsize)
            blocks = _blocks(tuple(ha.shape), itemsize, BLOCK_BYTES)
            index = next(blocks)
            for following in itertools.chain(blocks, [None]):
                n = math.prod(_block_shape(ha.shape, index))
                yield _Unit(i, (ha, hb), index, n * (ha.dtype.itemsize + hb.dtype.itemsize), following is None)
                index = following

    bar = display.Progress(progress, desc="diff")
    bar.total(sum((ha.nbytes + hb.nbytes) for i, ha, hb in work if accs[i].mode is not None))
    pool = ThreadPoolExecutor(COMPUTE_THREADS, thread_name_prefix="th5-compare-math")
    stream = _streamed(units(), 2, verify, shared=sa is sb)
    try:
        for unit, (ta, tb) in stream:
            accs[unit.row].add(pool, ta, tb)
            del ta, tb
            bar.update(unit.nbytes)
            if unit.last:
                row = rows[unit.row]
                row["changed"], row["max_abs"], row["rel_l2"] = accs.pop(unit.row).numbers()
                if row["status"] == "equal" and row["changed"]:
                    row["status"] = "changed"
    finally:
        stream.close()  # its reads finish before the stores close
        pool.shutdown(wait=True)
        bar.close()
    for i, acc in accs.items():  # not read: dtypes without arithmetic between them
        rows[i]["changed"] = None
    return Diff(rows, sa.path, sb.path)


def _block_shape(shape: Sequence[int], index: Any) -> tuple[int, ...]:
    """The shape of ``index`` (from :func:`_blocks`) of a tensor of ``shape``."""
    if index is Ellipsis:
        return tuple(shape)
    k = len(index) - 1
    sl = index[k]
    return (sl.stop - sl.start, *shape[k + 1:])


# ---------------------------------------------------------------------------- stats


_AMINMAX: dict[torch.dtype, bool] = {}


def _native_minmax(dtype: torch.dtype) -> bool:
    """Whether torch's ``aminmax`` takes ``dtype`` (not uint16/32/64 nor float8)."""
    ok = _AMINMAX.get(dtype)
    if ok is None:
        try:
            torch.aminmax(torch.zeros(16, dtype=torch.uint8).view(dtype))
            ok = True
        except (RuntimeError, TypeError):
            ok = False
        _AMINMAX[dtype] = ok
    return ok


class _StatsAcc:
    """Count, mean and M2 of the finite values (merged chunk by chunk in order, as Chan et al.),
    min and max of those not nan, and counts of nan, inf and zeros, in float64."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.kind = _kind(dtype)
        self.n, self.mean, self.m2 = 0, 0.0, 0.0
        self.lo: Any = None
        self.hi: Any = None
        self.nan = self.inf = self.zeros = 0

    def add(self, pool: ThreadPoolExecutor, t: torch.Tensor) -> None:
        if self.kind == "bits":
            return
        for n, mean, m2, lo, hi, nan, inf, zeros in _chunked(pool, self._chunk, t):
            self.nan += nan
            self.inf += inf
            self.zeros += zeros
            if n:
                total = self.n + n
                delta = mean - self.mean
                self.mean += delta * n / total
                self.m2 += m2 + delta * delta * self.n * n / total
                self.n = total
            if lo is not None:
                self.lo = lo if self.lo is None else min(self.lo, lo)
                self.hi = hi if self.hi is None else max(self.hi, hi)

    def _chunk(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``(finite count, their mean, their M2, min, max, nan, inf, zeros)`` of one chunk."""
        xd = _wide(x) if self.kind != "bool" else x.to(torch.float64)
        zeros = xd.numel() - int(torch.count_nonzero(xd))  # nan is not zero
        nan = inf = 0
        if self.kind == "complex":  # counts only: no order, and no mean asked of complex numbers
            nans = torch.isnan(xd)
            nan = int(nans.sum())
            return 0, 0.0, 0.0, None, None, nan, int(torch.isinf(xd).sum()), zeros
        var, m = torch.var_mean(xd, correction=0)
        mean, m2 = float(m), float(var) * xd.numel()
        f, kept = xd, x
        if not (math.isfinite(mean) and math.isfinite(m2)):  # nan or inf in the chunk (or squares that overflow)
            finite = torch.isfinite(xd)
            nans = torch.isnan(xd)
            nan = int(nans.sum())
            inf = xd.numel() - int(finite.sum()) - nan
            f, kept = xd[finite], x[~nans]
            mean = m2 = 0.0
            if f.numel():
                var, m = torch.var_mean(f, correction=0)
                mean, m2 = float(m), float(var) * f.numel()
        n = f.numel()
        lo = hi = None
        if kept.numel():
            if _native_minmax(kept.dtype):
                lo_t, hi_t = torch.aminmax(kept)
                lo, hi = _python(lo_t), _python(hi_t)
            else:  # float8, uint16/32/64: located in float64, read exactly
                wide = kept.to(torch.float64)
                lo, hi = _exact(kept, int(wide.argmin())), _exact(kept, int(wide.argmax()))
        return n, mean, m2, lo, hi, nan, inf, zeros

    def row(self) -> dict[str, Any]:
        if self.kind in ("bits", "complex"):
            numbers: dict[str, Any] = {"mean": None, "std": None, "min": None, "max": None}
        else:
            numbers = {"mean": self.mean if self.n else None,
                       "std": math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else None, "min": self.lo, "max": self.hi}
        counts = {"nan": self.nan, "inf": self.inf, "zeros": self.zeros} if self.kind != "bits" else \
            {"nan": None, "inf": None, "zeros": None}
        return {**numbers, **counts}


def _python(v: torch.Tensor) -> int | float | bool:
    if v.dtype == torch.bool:
        return bool(v)
    return float(v.to(torch.float64)) if v.is_floating_point() else int(v)


class _StatsTotals:
    __slots__ = ("tensors", "numel", "bad")

    def __init__(self) -> None:
        self.tensors = self.numel = self.bad = 0

    def add(self, row: _ViewRow) -> None:
        r = row.data
        self.tensors += 1
        self.numel += r["numel"]
        self.bad += bool(r["nan"] or r["inf"])

    def text(self, keys: int) -> str:
        bad = f"; {self.bad:,} with nan or inf" if self.bad else ""
        return f"{self.tensors:,} tensor{'s' * (self.tensors != 1)}, {self.numel:,} elements{bad}"


class Stats(_Rows):
    """What :func:`stats` found: a sequence of rows, one per tensor (plain values are left out),
    each a dict of ``key``, ``dtype``, ``shape``, ``numel``; ``mean`` and ``std`` of the finite
    elements (float64 sums; ``std`` with Bessel's correction, as ``torch.std``); ``min`` and
    ``max`` of the elements that are not nan (so an inf shows); counts of ``nan``, ``inf`` and
    ``zeros``. None where a number does not apply: no finite element (mean), fewer than two
    (std), complex tensors (mean, std, min, max), bit-typed tensors (all but ``numel``).
    Bool tensors count True as 1. In Jupyter: a tree of the keys, with each tensor's standard
    deviation per key (a figure) above it."""

    def __init__(self, rows: list[dict[str, Any]], source: str) -> None:
        super().__init__(rows)
        self.source = source

    def summary(self) -> str:
        bad = sum(1 for r in self._rows if r["nan"] or r["inf"])
        return (f"{self.source}: {len(self):,} tensor{'s' * (len(self) != 1)}, "
                f"{sum(r['numel'] for r in self._rows):,} elements, {bad:,} with nan or inf")

    def text(self) -> str:
        lines = [[r["key"], r["dtype"], str(r["shape"]), _fmt(r["mean"]), _fmt(r["std"]), _fmt(r["min"]),
                  _fmt(r["max"]), _fmt(r["nan"]), _fmt(r["inf"]), _fmt(r["zeros"])] for r in self._rows]
        table = _table(["key", "dtype", "shape", "mean", "std", "min", "max", "nan", "inf", "zeros"], lines,
                       set(range(3, 10))) + "\n" if lines else ""
        return table + self.summary()

    def __repr__(self) -> str:
        return f"<tensorstore_h5.Stats {self.summary()}>"

    def _repr_html_(self) -> str:
        stds = [math.nan if r["nan"] or r["inf"] else r["std"] for r in self._rows]
        lo, hi = _log_range([v for v in stds if v is not None])
        figure = _figure("standard deviation per tensor, in order (log scale; red: holds nan or inf", stds,
                         [r["key"] for r in self._rows])

        def cells(row: _ViewRow) -> tuple[str, ...]:
            r = row.data
            return (f"{r['dtype']} {r['shape']}", _fmt(r["mean"]), _fmt(r["std"]), _fmt(r["min"]), _fmt(r["max"]),
                    _fmt(r["nan"]), _fmt(r["inf"]), _fmt(r["zeros"]), _bar(stds[row.data["_i"]], lo, hi))

        columns = (views.Column("dtype, shape", dim=True), *(views.Column(h, "right") for h in
                   ("mean", "std", "min", "max", "nan", "inf", "zeros")), views.Column("std (log)"))
        view_rows = [_ViewRow(r["key"], {**r, "_i": i}) for i, r in enumerate(self._rows)]
        return views.tree_html(repr(self), view_rows, cells=cells, totals=_StatsTotals, columns=columns,
                                 head=figure)


def stats(source: Any, select: Selector = None, *, progress: bool | None = None, verify: bool | None = None,
          opener: Callable[[Any], Any] | None = None) -> Stats:
    """Per-tensor statistics of a checkpoint, streaming and in float64 (see :class:`Stats` for
    the row fields, and nan and inf): ``mean``, ``std``, ``min``, ``max`` and counts of
    ``nan``, ``inf`` and ``zeros``. Tensors are read ahead on a thread of their own, in blocks
    of rows where larger than :data:`BLOCK_BYTES`, as for :func:`diff`; the arithmetic runs on
    torch's threads. ``source``, ``select``, ``progress``, ``verify`` and ``opener`` are as for
    :func:`diff` (``select`` must name keys that are there).

    Raises:
        KeyNotFoundError: an exact key of ``select`` is not there.
        FormatError, TensorStoreError: as the reads raise them.
    """
    store, owned = _source(source, opener)
    try:
        rows: list[dict[str, Any]] = []
        work: list[tuple[int, Any]] = []
        for key in store.selected_keys(select):
            h = _as_handle(store[key])
            if not _is_handle(h):
                continue
            rows.append({"key": key, "dtype": _dtype_name(h.dtype), "shape": list(h.shape),
                         "numel": math.prod(h.shape)})
            work.append((len(rows) - 1, h))
        accs = {i: _StatsAcc(h.dtype) for i, h in work}

        def units() -> Iterator[_Unit]:
            for i, h in work:
                if accs[i].kind == "bits":
                    continue
                blocks = _blocks(tuple(h.shape), h.dtype.itemsize, BLOCK_BYTES)
                index = next(blocks)
                for following in itertools.chain(blocks, [None]):
                    yield _Unit(i, (h,), index, math.prod(_block_shape(h.shape, index)) * h.dtype.itemsize,
                                following is None)
                    index = following

        bar = display.Progress(progress, desc="stats")
        bar.total(sum(h.nbytes for i, h in work if accs[i].kind != "bits"))
        pool = ThreadPoolExecutor(COMPUTE_THREADS, thread_name_prefix="th5-compare-math")
        stream = _streamed(units(), 1, verify)
        try:
            for unit, (t,) in stream:
                accs[unit.row].add(pool, t)
                del t
                bar.update(unit.nbytes)
        finally:
            stream.close()  # its reads finish before the store closes
            pool.shutdown(wait=True)
            bar.close()
        for i, acc in accs.items():
            rows[i].update(acc.row())
        return Stats(rows, store.path)
    finally:
        if owned:
            store.close()
