"""The functions most people call: :func:`load` and :func:`load_into` (``save`` lives in writer.py)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections import OrderedDict, namedtuple
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Union

import torch

from .errors import MismatchError, NAMED_KEYS, few
from .format import tree
from .format.layout import Container, TensorEntry
from .reading.select import Selector
from .reading.store import Store
from .storage import memory

if TYPE_CHECKING:
    from .sharded import ShardedStore
    from .transfer import Device
    PathLike = Union[str, "os.PathLike[str]"]  # (annotations only: the alias is ~0.07 ms of an import)

__all__ = ["load", "load_into", "LoadResult"]


def _is_directory(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isdir(path)


def _open(path: Any, storage_options: dict[str, Any] | None) -> Store | ShardedStore:
    """The store of ``path``, as :func:`tensorstore_h5.open` makes it (there, in the package, a
    file's open imports no api.py)."""
    if _is_directory(path):
        from .sharded import ShardedStore

        return ShardedStore(path)
    return Store(path, storage_options=storage_options)


def load(path: Any, *, select: Selector = None, device: Device = None, progress: bool | None = None,
         mmap: bool = False, verify: bool | None = None, storage_options: dict[str, Any] | None = None) -> Any:
    """Load a file (or the selected part of it) back into its saved nesting. Python's cyclic
    garbage collector is paused while the tensors are built (:func:`tensorstore_h5.storage.memory.gc_paused`).

    Example::

        sd = th5.load("ckpt.h5", select="model/*")["model"]
        layer0 = th5.load("ckpt.h5", select=["model/layers/0"])
        model.load_state_dict(th5.load("ckpt.h5")["model"])   # module versions (_metadata) kept

    Args:
        path: the file: a local path, an fsspec URL (``https://``, ``s3://``; only the
            selected bytes and the layout are fetched) or a readable, seekable binary file object.
        select: None (everything), a glob on key paths, a list of exact keys or globs, or a
            callable ``key_path -> bool``. Exact keys may name a container (its whole subtree).
        device: None (CPU), a device, or a mapping (key path or glob -> device) or callable.
            Tensors are allocated on it explicitly, whatever torch's default device is.
        progress: see :func:`tensorstore_h5.save`.
        mmap: tensors backed by the file's pages (copy-on-write) where the data allow, see
            :meth:`Store.load`.
        verify: check the stored checksums: by default (None) of every tensor read (not of
            those ``mmap`` maps), True of all, False of none (see :meth:`Store.load`).
        storage_options: for a URL, passed to fsspec (credentials, endpoint, ...).

    Raises:
        KeyNotFoundError: an exact key in ``select`` is not in the file (a KeyError).
        FormatError: the file is not readable as a checkpoint, or a checksum does not match.
        TensorStoreError: a device that does not exist here.
    """
    if _is_directory(path):  # a checkpoint directory (docs/DISTRIBUTED.md)
        if mmap:
            raise ValueError(f"{os.fspath(path)}: mmap=True maps one file; a checkpoint directory is read into memory")
        from .sharded import ShardedStore

        with ShardedStore(path) as sharded, memory.gc_paused():
            return sharded.load(select=select, device=device, progress=progress, verify=verify)
    with Store(path, storage_options=storage_options) as store:
        return store.load(select=select, device=device, progress=progress, mmap=mmap, verify=verify)


_Keys = namedtuple("_Keys", ["missing_keys", "unexpected_keys"])  # (typing.NamedTuple: ~0.1 ms more of an import)


class LoadResult(_Keys):
    """Keys (``list[str]`` each) that :func:`load_into` could not match, like
    ``Module.load_state_dict``'s result: the pair ``(missing_keys, unexpected_keys)`` (it
    unpacks and compares as that pair), and ``meta_keys``, the targets left on the meta device
    (with no data) after the load."""

    def __new__(cls, missing_keys: list[str], unexpected_keys: list[str], meta_keys: list[str] | None = None
                ) -> LoadResult:
        self = super().__new__(cls, missing_keys, unexpected_keys)
        self.__dict__["meta_keys"] = list(meta_keys or [])
        return self

    @property
    def meta_keys(self) -> list[str]:
        """Key paths (target side, as ``missing_keys``) of the parameters and buffers, persistent
        or not, still on the meta device after the load: the file had nothing for them."""
        return self.__dict__.setdefault("meta_keys", [])

    def __repr__(self) -> str:
        extra = f", meta_keys={self.meta_keys!r}" if self.meta_keys else ""
        return f"LoadResult(missing_keys={self.missing_keys!r}, unexpected_keys={self.unexpected_keys!r}{extra})"


def _slots(target: Any, path: str = "") -> dict[str, tuple[Any, Any]]:
    """Key path -> (container, key) of every tensor in a nested dict/list of tensors."""
    out: dict[str, tuple[Any, Any]] = {}
    items = target.items() if isinstance(target, Mapping) else enumerate(target)
    for k, v in items:
        name = tree.name_for_key(k, path) if isinstance(target, Mapping) else str(k)
        p = tree.join(path, name)
        if isinstance(v, torch.Tensor):
            out[p] = (target, k)
        elif isinstance(v, (Mapping, list)):
            out.update(_slots(v, p))
    return out


def _needs_module_loader(module: torch.nn.Module, versions: Mapping[str, Any] | None) -> bool:
    """True when filling the tensors in place would skip something ``load_state_dict`` does:
    a module whose own ``_load_from_state_dict`` sees another version than the one stored
    (it converts old checkpoints), or load-state-dict hooks."""
    for name, m in module.named_modules():
        if m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks:
            return True
        if type(m)._load_from_state_dict is not torch.nn.Module._load_from_state_dict:
            stored = (versions or {}).get(name, {}).get("version")
            if stored != getattr(m, "_version", None):
                return True
    return False


def _view(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same view of the same memory (tied targets)."""
    return t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def _alias_groups(targets: dict[str, torch.Tensor], order: list[str]) -> tuple[list[str], list[str]]:
    """Of targets that are one tensor (the same view of the same memory), the key filled: the
    last in file order; ``(keys to fill, problems)``. Targets whose memory overlaps without
    being the same view are a problem (which value would win is undefined)."""
    rank = {k: i for i, k in enumerate(order)}
    groups: dict[tuple[Any, ...], list[str]] = {}
    spans = []
    for k in order:
        t = targets[k]
        if t.is_meta or t.numel() == 0:
            groups[("own", k)] = [k]
            continue
        ident = _view(t)
        if ident not in groups:
            lo = t.data_ptr()
            hi = lo + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
            spans.append((str(t.device), lo, hi, k))
        groups.setdefault(ident, []).append(k)
    problems = []
    spans.sort()
    for (d0, _, hi0, k0), (d1, lo1, _, k1) in zip(spans, spans[1:]):
        if d0 == d1 and lo1 < hi0:
            problems.append(f"targets {k0!r} and {k1!r} share memory without being the same tensor")
    fill = [max(keys, key=rank.__getitem__) for keys in groups.values()]
    return sorted(fill, key=rank.__getitem__), problems


@contextlib.contextmanager
def _watching_unfilled(module: torch.nn.Module, lacking: list[str], left: list[str]) -> Iterator[None]:
    """While ``module.load_state_dict`` runs, append to ``left`` each of the ``lacking`` keys
    (state-dict names the file has no tensor for) whose module, after its own conversion of the
    state dict, is handed its own current tensor back: nothing loaded it. A pre-hook of the
    base ``Module._load_from_state_dict`` sees the state dict as the subclass converted it."""
    by_module: dict[str, list[str]] = {}
    for key in lacking:
        owner, _, name = key.rpartition(".")
        by_module.setdefault(owner, []).append(name)
    handles = []

    def hook(m: torch.nn.Module, state_dict: Mapping[str, Any], prefix: str, *_: Any, names: list[str]) -> None:
        for n in names:
            own = m._parameters.get(n, m._buffers.get(n))
            if own is not None and state_dict.get(prefix + n) is own:
                left.append(prefix + n)

    try:
        for owner, names in by_module.items():
            try:
                sub = module.get_submodule(owner)
            except AttributeError:
                continue
            handles.append(sub.register_load_state_dict_pre_hook(functools.partial(hook, names=names)))
        yield
    finally:
        for h in handles:
            h.remove()


def _tied_to_loaded(targets: dict[str, torch.Tensor], missing: list[str], loaded: list[str]) -> dict[str, str]:
    """Of the ``missing`` target keys, those whose tensor is a ``loaded`` target's tensor (the
    same object, or the same view of the same memory: tied weights such as ``lm_head.weight``
    of a checkpoint saved without it, as transformers saves tied embeddings), each mapped to
    that loaded key; loading it fills them."""
    if not missing:
        return {}
    by_view: dict[Any, str] = {}
    for k in loaded:
        t = targets[k]
        by_view.setdefault(id(t), k)
        if not t.is_meta and t.numel():
            by_view.setdefault(_view(t), k)
    out = {}
    for k in missing:
        t = targets[k]
        other = by_view.get(id(t))
        if other is None and not t.is_meta and t.numel():
            other = by_view.get(_view(t))
        if other is not None:
            out[k] = other
    return out


def _problem(what: str, keys: list[str]) -> list[str]:
    return [f"{what}: {few(keys)}"] if keys else []


def _prefix_hint(file_keys: list[str], targets: Mapping[str, Any], prefix: str, matched: int) -> str:
    """When another ``prefix`` would match more than half of the target's keys, and more than
    ``prefix`` does (``matched``), the sentence that suggests it: every file key cut after each
    ``/`` and ``.`` (``model/``, ``model.``) is looked up among the targets. Empty otherwise."""
    counts: dict[str, int] = {}
    for k in file_keys:
        for i, c in enumerate(k):
            if (c == "/" or c == ".") and k[i + 1:] in targets:
                counts[k[:i + 1]] = counts.get(k[:i + 1], 0) + 1
        if k in targets:
            counts[""] = counts.get("", 0) + 1
    best = max(counts.values(), default=0)
    if best <= matched or 2 * best <= len(targets):  # a prefix that fits most of the target, better than the one given
        return ""
    which = [p for p, n in counts.items() if n == best and p != prefix]
    if not which:
        return ""
    spelled = " or ".join(f"prefix={p!r}" for p in which[:3]) + (" or ..." if len(which) > 3 else "")
    return (f"; did you mean {spelled}? (the file's keys match {best} of the target's {len(targets)} keys with it, "
            f"{matched} with prefix={prefix!r})")


def _still_on_meta(target: Any) -> list[str]:
    """Key paths (as ``missing_keys`` names them) of the target's tensors on the meta device:
    every parameter and buffer of a module, persistent or not, or every tensor of a nested dict."""
    if isinstance(target, torch.nn.Module):
        named = [*target.named_parameters(remove_duplicate=False), *target.named_buffers(remove_duplicate=False)]
        return list(dict.fromkeys(tree.escape(k) for k, t in named if t is not None and t.is_meta))
    if isinstance(target, Mapping):
        return [p for p, (c, k) in _slots(target).items() if c[k].is_meta]
    return []


def _warn_on_meta(target: Any, path: Any, result: LoadResult) -> LoadResult:
    """``result`` with ``meta_keys``; a TensorStoreWarning naming them when there are any."""
    meta = _still_on_meta(target)
    if meta:
        import warnings

        from .errors import TensorStoreWarning

        name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else getattr(path, "name", type(path).__name__)
        warnings.warn(f"{name}: {len(meta)} target tensor(s) are still on the meta device after load_into, without "
                      f"data (nothing in the file, as selected, was loaded into them; a model would compute garbage or fail): "
                      f"{few([repr(k) for k in meta])}. Fill them before use (LoadResult.meta_keys lists them): a "
                      "non-persistent buffer (such as position_ids) is made by its module's __init__, so build the "
                      "model on a real device, or set the buffer yourself",
                      TensorStoreWarning, stacklevel=3)
    return LoadResult(result.missing_keys, result.unexpected_keys, meta)


def load_into(
    target: Any,
    path: PathLike,
    *,
    select: Selector = None,
    prefix: str = "",
    strict: bool = True,
    assign: bool = False,
    device: Any = None,
    strict_dtype: bool = False,
    progress: bool | None = None,
    verify: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> LoadResult:
    """Fill the tensors of ``target`` from ``path``, like ``target.load_state_dict``, reading
    each tensor's bytes straight into it (same ``data_ptr``).

    ``target`` is an ``nn.Module`` (its ``state_dict(keep_vars=True)``: parameters and
    persistent buffers) or a nested dict of tensors; ``path`` a file, URL or file object as
    for :func:`load`, or a checkpoint directory (docs/DISTRIBUTED.md: each target gets its
    global tensor, assembled from the pieces). The stored key path of a target tensor
    is ``prefix`` + its key path (``prefix="model/"`` for a file saved as ``{"model": sd}``).
    Everything is checked before anything is written. Python's cyclic garbage collector is
    paused meanwhile (:func:`tensorstore_h5.storage.memory.gc_paused`).

    - A stored tensor of another dtype is cast into the target, as ``copy_`` does (unless
      ``strict_dtype``); shapes must match.
    - Targets that are one tensor (tied weights) are filled once, from the last of their
      keys in file order; a file may hold only one of their keys (transformers saves tied
      embeddings without ``lm_head.weight``), which loads strictly. Targets that share
      memory otherwise are refused.
    - Targets on the meta device (``init_empty_weights``) need ``assign=True``, which
      replaces every loaded parameter and buffer by a new tensor read from the file, as
      ``load_state_dict(assign=True)`` does (``nn.Parameter`` and ``requires_grad`` of the
      module kept), on ``device`` or each target's device (the CPU for meta targets).
    - A module whose ``_load_from_state_dict`` converts checkpoints of another version than
      the file's (saved ``state_dict()._metadata``), or that has load-state-dict hooks, is
      loaded through ``load_state_dict`` itself with the file's versions (after the same
      checks), so it converts the tensors as it would from ``torch.load``.

    Args:
        select: keys of the file to consider (see :func:`load`).
        prefix: stored key path prefix of the target's keys.
        strict: refuse missing and unexpected keys.
        assign: see above.
        device: with ``assign``, where the new tensors go.
        strict_dtype: refuse dtype differences instead of casting.
        progress: see :func:`tensorstore_h5.save`.
        verify: check every stored checksum before any target changes (the default; one
            more pass over the bytes, hashed on the I/O threads). Over a URL the default
            checks each fetched batch before its targets are written (True: all of them
            first, fetching the bytes twice). False checks nothing.
        storage_options: for a URL ``path``, passed to fsspec.

    Returns:
        LoadResult(missing_keys, unexpected_keys), target-side and file-side key paths
        (``missing_keys``: every target key the file lacks, but tied ones it fills; also those
        a module's own loader accepts missing, such as BatchNorm's ``num_batches_tracked`` in
        a file saved without module versions, which stay as they were), and
        its ``meta_keys``: the target's parameters and buffers (persistent or not) still on the
        meta device afterwards, which the file had nothing for (with ``strict=False``, or
        non-persistent buffers such as ``position_ids``); a :class:`TensorStoreWarning`
        names them. A strict mismatch that another ``prefix`` would resolve says which.

    Raises:
        MismatchError: strict and some keys are missing or unexpected; a shape (or, with
            ``strict_dtype``, a dtype) differs; meta targets without ``assign``; targets
            that overlap. No target has changed. Messages name a few keys, then how many more.
        KeyNotFoundError: an exact key in ``select`` is not in the file.
        FormatError: the file is not readable as a checkpoint, or a checksum does not match
            (nothing changed).
        RemoteError: over a URL, a request failed for good (after ``remote.RETRIES``); the
            file's checks come first, but the batches fetched before the failure have been
            written to their targets (holding every batch back would need memory for all of
            them). The message names the failed batch's keys.
    """
    if device is not None and not assign:
        raise ValueError("device= says where assign=True puts new tensors; without assign, targets keep their memory")
    with memory.gc_paused():  # many new objects, none in a cycle
        result = _load_into(target, path, select, prefix, strict, assign, device, strict_dtype, progress, verify,
                            storage_options)
    return _warn_on_meta(target, path, result)


def _load_into(target: Any, path: PathLike, select: Selector, prefix: str, strict: bool, assign: bool, device: Any,
               strict_dtype: bool, progress: bool | None, verify: bool | None,
               storage_options: dict[str, Any] | None) -> LoadResult:
    module = target if isinstance(target, torch.nn.Module) else None
    if module is not None:
        names = {tree.escape(k): k for k in module.state_dict(keep_vars=True)}
        targets = {e: v for e, v in zip(names, module.state_dict(keep_vars=True).values())}
    elif isinstance(target, Mapping):
        slots = _slots(target)
        targets = {p: c[k] for p, (c, k) in slots.items()}
    else:
        raise TypeError(f"load_into needs an nn.Module or a nested dict of tensors, got {type(target).__name__}")
    with _open(path, storage_options) as store:
        tensor_kinds: tuple[type, ...] = (TensorEntry,)
        if not isinstance(store, Store):  # a directory: sharded is imported already
            from .sharded import ShardedTensorEntry

            tensor_kinds = (TensorEntry, ShardedTensorEntry)
        all_keys = store.selected_keys(select)
        file_keys = [k for k in all_keys if k.startswith(prefix)]
        stored = {k[len(prefix):]: k for k in file_keys}
        missing = [k for k in targets if k not in stored]
        tied = _tied_to_loaded(targets, missing, [k for k in targets if k in stored])
        missing = [k for k in missing if k not in tied]  # filled through the tensor they are (tied weights)
        unexpected = [stored[k] for k in stored if k not in targets]
        holder = store._layout.entry(prefix[:-1] if prefix.endswith("/") else prefix)
        versions = holder.module_metadata if isinstance(holder, Container) else None
        through_module = module is not None and (assign or _needs_module_loader(module, versions))
        order = [k[len(prefix):] for k in file_keys if k[len(prefix):] in targets]
        not_tensor, shapes, dtypes, meta = [], [], [], []
        for k in order:
            entry, t = store._entry(stored[k]), targets[k]
            if not isinstance(entry, tensor_kinds):
                not_tensor.append(repr(stored[k]))
            elif tuple(entry.shape) != tuple(t.shape):
                shapes.append(f"{stored[k]!r} (stored {list(entry.shape)}, target {list(t.shape)})")
            elif strict_dtype and entry.dtype.torch_dtype != t.dtype:
                dtypes.append(f"{stored[k]!r} (stored {entry.dtype.name}, target {str(t.dtype).removeprefix('torch.')})")
            elif t.is_meta and not assign:
                meta.append(repr(k))
        problems = []
        hint = _prefix_hint(all_keys, targets, prefix, len(order)) if strict and (missing or unexpected) else ""
        if strict and (missing or unexpected) and not through_module:
            problems += _problem("missing keys", [repr(k) for k in missing])
            problems += _problem("unexpected keys", [repr(k) for k in unexpected])
            problems[-1] += hint
        problems += _problem("shapes differ", shapes) + _problem("not tensors in the file", not_tensor)
        problems += _problem("dtypes differ (strict_dtype)", dtypes)
        if meta:
            problems.append(f"targets on the meta device (no memory to fill): {few(meta)}; pass assign=True to "
                            "materialise them from the file")
        fill, overlap = _alias_groups(targets, order) if not assign else (order, [])
        problems += overlap[:NAMED_KEYS]
        if problems:
            raise MismatchError(f"{store.path}: cannot load into the target; nothing was changed: " + "; ".join(problems))

        def place(key: str) -> Any:
            t = targets.get(key[len(prefix):])
            return device if device is not None else (None if t is None or t.is_meta else t.device)

        if through_module:
            assert module is not None
            sd: OrderedDict[str, Any] = OrderedDict()
            for key, value in store.items(select=file_keys, device=place, verify=verify):
                rel = key[len(prefix):]
                sd[names.get(rel, rel)] = value
            for k, other in tied.items():  # the module's loader wants every key; the tensor is the same
                if names.get(other, other) in sd:
                    sd[names.get(k, k)] = sd[names.get(other, other)]
            if versions is not None:
                sd._metadata = OrderedDict((p, dict(v)) for p, v in versions.items())  # type: ignore[attr-defined]
            left: list[str] = []
            with _watching_unfilled(module, [names.get(k, k) for k in missing], left):
                try:
                    result = module.load_state_dict(sd, strict=strict, assign=assign)
                except RuntimeError as e:
                    raise MismatchError(f"{store.path}: load_state_dict refused the checkpoint: "
                                        f"{str(e).rstrip()}{hint}") from e
            # what the file lacks and nothing filled, also where a module's loader accepted the absence and put the
            # target's own tensor back (BatchNorm's num_batches_tracked in a file without versions), as a direct
            # load reports it; a tensor a converter made from other keys (an old version's names) is filled
            lacking = {tree.escape(k) for k in [*result.missing_keys, *left]}
            return LoadResult([k for k in targets if k in lacking], [prefix + tree.escape(k) for k in result.unexpected_keys])
        if assign:  # every new tensor read (and checked) before any slot changes
            loaded = list(store.items(select=[stored[k] for k in order], device=place, verify=verify))
            for key, value in loaded:
                container, k = slots[key[len(prefix):]]
                container[k] = value
            for k, other in tied.items():  # still one tensor, as before
                container, name = slots[k]
                source, source_name = slots[other]
                container[name] = source[source_name]
            return LoadResult(missing, unexpected)
        store._read_into([(store._entry(stored[k]), targets[k]) for k in fill], progress, verify)
    return LoadResult(missing, unexpected)
