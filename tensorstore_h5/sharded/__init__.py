"""Checkpoint directories as one logical store: the sharded index (docs/FORMAT.md, "Sharded
checkpoints (directories)"), :class:`ShardedStore` over a directory written by
:mod:`tensorstore_h5.distributed` or by :func:`from_safetensors_dir`, the same view over a
Hugging Face sharded safetensors checkpoint, and conversions between them, key by key.

A directory holds format-2 files named ``<name>.<save id>.h5`` and the index
``tensorstore_h5.json``, written last. The index holds the *global* tree (keys, dtypes, shapes
and plain values of the whole checkpoint) and, for every tensor, its **pieces**: which dataset
of which file holds which block of it. Reading ``h[a:b]`` opens only the files whose pieces
overlap the selection and reads only the overlap of each piece (its hyperslab), straight into
the result where the destination is contiguous.

The modules, each importing only those before it: ``index`` (names, pieces, the index and its
commit), ``reads`` (a piece's file and its hyperslab reads), ``safetensors`` (Hugging Face
directories as an index), ``store`` (:class:`ShardedStore`), ``convert`` (conversions).
Nothing here imports ``torch.distributed``; the DCP backend builds on these pieces.
"""

from __future__ import annotations

from .convert import convert_dir, from_safetensors_dir, to_file
from .index import (
    DirectoryIndex, INDEX_FORMAT, INDEX_NAME, INDEX_VERSION, Piece, ShardedArrayEntry, ShardedTensorEntry, check_cover,
    commit_index, data_file_name, file_info, index_text, new_save_id, parse_index, rank_index_name, rank_stem,
)
from .store import ShardedStore, ShardedTensorHandle, is_checkpoint_directory, open_directory

__all__ = [
    "INDEX_NAME", "INDEX_FORMAT", "INDEX_VERSION", "ShardedStore", "ShardedTensorHandle", "Piece", "DirectoryIndex",
    "ShardedTensorEntry", "ShardedArrayEntry", "open_directory", "is_checkpoint_directory", "parse_index", "index_text",
    "commit_index", "check_cover", "new_save_id", "data_file_name", "rank_index_name", "rank_stem",
    "file_info", "to_file", "from_safetensors_dir", "convert_dir",
]
