"""Conversions of checkpoint directories, key by key (at most the current and the previous
tensor in memory): a directory into one file, a Hugging Face checkpoint into a tensorstore_h5
directory."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from ..format import layout as fmt
from ..format.tree import Container, Leaf
from ..reading.select import Selector, resolve
from .index import (
    INDEX_FORMAT, INDEX_NAME, INDEX_VERSION, PathLike, ShardedArrayEntry, ShardedTensorEntry, commit_index,
    data_file_name, file_info, index_text, new_save_id, parse_index, sanitize_stem,
)
from .store import ShardedStore

__all__ = ["to_file", "from_safetensors_dir", "convert_dir"]

# ---------------------------------------------------------------------------- conversions


def to_file(src: PathLike, dst: PathLike, *, select: Selector = None, verify: bool = True,
            metadata: Mapping[str, Any] | None = None, **save_options: Any) -> None:
    """Write a checkpoint directory (ours, or Hugging Face safetensors) as one tensorstore_h5
    file, key by key: each global tensor is assembled from its pieces when the writer reaches
    it and dropped once written (at most the one being written and the one before are in memory).

    ``save_options`` go to :class:`tensorstore_h5.Writer` (``compression=``, ``chunk_bytes=``,
    ``progress=``, ``sync=``). ``verify`` checks every piece's checksums first (tensorstore_h5
    directories). The nesting, containers and plain values are kept.
    """
    from ..writing.writer import Writer, few_links

    with ShardedStore(src) as store:
        meta = dict(metadata) if metadata is not None else store.metadata
        included = resolve(select, store._layout.leaf_paths, store._layout.container_paths, store.path)
        entries = store._layout.select(included)

        def nodes() -> Iterator[Any]:
            for e in entries:
                yield e if isinstance(e, Container) else Leaf(e.path, e.key, store._read_leaf(e, None, verify))

        with Writer(dst, metadata=meta, **save_options, _encode=few_links([e.path for e in entries])) as w:
            w.expect_bytes(sum(e.nbytes for e in entries if isinstance(e, (ShardedTensorEntry, ShardedArrayEntry))))
            w.write_tree(nodes())


def from_safetensors_dir(src: PathLike, dst: PathLike, *, compression: Any = None, chunk_bytes: int | None = None,
                         sync: bool = False, metadata: Mapping[str, Any] | None = None,
                         progress: bool | None = None) -> list[str]:
    """Convert a Hugging Face sharded safetensors checkpoint into a tensorstore_h5 directory:
    one format-2 file per shard (``<shard stem>.<save id>.h5``), then the index, key by key
    (one tensor in memory at a time). ``dst`` may already hold a checkpoint: it is replaced as
    a save replaces it (the index last; files of the old one removed after). Returns the names
    of the files written.
    """
    from ..writing.writer import Writer, few_links

    dst = os.fspath(dst)
    os.makedirs(dst, exist_ok=True)
    save_id = new_save_id()
    with ShardedStore(src) as store:
        if store.kind != "safetensors":
            raise ValueError(f"{store.path}: not a safetensors checkpoint directory")
        leaves = [e for e in store._layout.entries if isinstance(e, ShardedTensorEntry)]
        by_file: dict[str, list[ShardedTensorEntry]] = {}
        for e in leaves:
            by_file.setdefault(e.pieces[0].file, []).append(e)
        names: dict[str, str] = {}
        files: dict[str, Any] = {}
        for shard, entries in by_file.items():
            stem = sanitize_stem(shard.removesuffix(".safetensors"))
            name = data_file_name(stem, save_id)
            path = os.path.join(dst, name)
            with Writer(path, compression=compression, chunk_bytes=chunk_bytes, sync=sync, progress=progress,
                        metadata={"save_id": save_id, "source": shard}, _encode=few_links([e.path for e in entries])) as w:
                for e in entries:
                    t = store._read_leaf(e, None, False)
                    w.write(e.path, t)
                    del t
            files[name] = file_info(path)
            names[shard] = name
        paths, types, out = [""], ["dict"], [{}]
        for e in leaves:
            paths.append(e.path)
            types.append("tensor")
            out.append({"dtype": e.dtype.name, "shape": list(e.shape),
                        "pieces": [{"file": names[e.pieces[0].file], "offsets": [0] * len(e.shape), "shape": list(e.shape)}]})
        meta = dict(metadata) if metadata is not None else store.metadata
    fmt.check_metadata(meta)
    obj = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "save_id": save_id, "metadata": meta, "files": files,
           "paths": paths, "types": types, "entries": out}
    parse_index(index_text(obj), os.path.join(dst, INDEX_NAME)).entries  # every entry checked before it is committed
    commit_index(dst, obj, sync=sync)
    return list(files)


def convert_dir(src: PathLike, dst: PathLike, *, select: Selector = None, **options: Any) -> None:
    """``tensorstore-h5 convert`` for directories: a directory (ours or Hugging Face) to one
    ``.h5``/``.hdf5`` file (:func:`to_file`), or a Hugging Face directory to a tensorstore_h5
    directory (:func:`from_safetensors_dir`)."""
    s, d = os.fspath(src), os.fspath(dst)
    if d.lower().endswith((".h5", ".hdf5")):
        to_file(s, d, select=select, **options)
        return
    if select is not None:
        raise ValueError("select applies to a conversion into one .h5 file")
    if os.path.exists(d) and not os.path.isdir(d):
        raise ValueError(f"{d}: the destination of a directory conversion is a directory or an .h5 file")
    from_safetensors_dir(s, d, **options)
