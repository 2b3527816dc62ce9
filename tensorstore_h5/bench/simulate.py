"""Directories as N ranks would write them, in one process and without a process group.

:func:`save_as_ranks` runs :class:`~tensorstore_h5.distributed.H5StorageWriter`'s own steps
(DCP's global plan, ``prepare_global_plan``, every rank's ``write_data``, the coordinator's
``finish``) on the chunks that ``ranks`` processes holding ``Shard(dim)`` DTensors would hold:
the files and index are those of a real N-rank save. :func:`index_size` builds only the index
(no data), to measure how the metadata grows with the number of ranks.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .. import sharded
from ..distributed.backend import H5StorageWriter, _Stored, key_path
from ..storage import memory

__all__ = ["shard_bounds", "save_as_ranks", "index_size", "index_scaling", "llama_shapes"]


def shard_bounds(n: int, ranks: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each rank's block of ``n`` rows, as DTensor's ``Shard`` splits
    them (``torch.chunk``: blocks of ``ceil(n / ranks)``, the last ones shorter or empty)."""
    return [_bounds(n, ranks, r) for r in range(ranks)]


def _bounds(n: int, ranks: int, r: int) -> tuple[int, int]:
    size = -(-n // ranks) if n else 0
    start = min(r * size, n)
    return start, min(size, n - start)


class _Planner:
    """The part of a SavePlanner that ``write_data`` uses: the chunk of each item."""

    def __init__(self, chunks: Mapping[MetadataIndex, torch.Tensor], mappings: Mapping[str, Any] | None) -> None:
        self.chunks = chunks
        self.mappings = mappings

    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        return self.chunks[item.index]


def _plans(state_dict: Mapping[str, torch.Tensor], ranks: int, dim: int,
           ) -> tuple[list[SavePlan], list[dict[MetadataIndex, torch.Tensor]]]:
    plans, chunks = [], []
    for r in range(ranks):
        items, mine = [], {}
        for fqn, t in state_dict.items():
            d = dim if t.ndim > dim else None
            if d is None and r:
                continue  # not shardable along dim: replicated, and DCP keeps rank 0's copy
            start, length = _bounds(t.shape[d], ranks, r) if d is not None else (0, 0)
            offsets = [0] * t.ndim
            sizes = list(t.shape)
            if d is not None:
                offsets[d], sizes[d] = start, length
            index = MetadataIndex(fqn, offsets)
            items.append(WriteItem(index=index, type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                               properties=TensorProperties(dtype=t.dtype), size=t.shape)))
            mine[index] = t.narrow(d, start, length) if d is not None else t
        plans.append(SavePlan(items))
        chunks.append(mine)
    return plans, chunks


def save_as_ranks(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike[str], ranks: int, dim: int = 0,
                  mappings: Mapping[str, tuple[Any, ...]] | None = None, **writer_options: Any) -> None:
    """Write ``state_dict`` (flat: DCP key -> tensor) to the directory ``path`` as ``ranks``
    processes holding each tensor as a ``Shard(dim)`` DTensor would (tensors with fewer
    dimensions are replicated). ``mappings`` (DCP key -> object path) nests the key paths as
    DCP's flattening does. ``writer_options`` go to :class:`H5StorageWriter`."""
    writer_options.setdefault("sync_files", False)
    plans, chunks = _plans(state_dict, ranks, dim)
    plans, metadata = create_default_global_save_plan(plans)
    if mappings is not None:
        metadata.planner_data = dict(mappings)
    writers = [H5StorageWriter(path, **writer_options) for _ in range(ranks)]
    for r, w in enumerate(writers):
        w.set_up_storage_writer(r == 0, rank=r, use_collectives=True)
        w.prepare_local_plan(plans[r])
    plans = writers[0].prepare_global_plan(plans)
    results = [w.write_data(plans[r], _Planner(chunks[r], mappings)).value() for r, w in enumerate(writers)]
    writers[0].finish(metadata, results)


def index_size(shapes: Mapping[str, tuple[int, ...]], ranks: int, dim: int = 0,
               dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Bytes of the index of a ``ranks``-rank save of tensors of ``shapes`` (``Shard(dim)``),
    built by the writer's own code from the results the ranks would report (no data is
    written), and of the pickled ``.metadata`` that DCP's ``FileSystemWriter`` would write for
    the same save."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    state = {fqn: torch.empty(shape, dtype=dtype, device="meta") for fqn, shape in shapes.items()}
    plans, _ = _plans(state, ranks, dim)
    plans, metadata = create_default_global_save_plan(plans)
    writer = H5StorageWriter(os.devnull, sync_files=False)
    writer._save_id = sharded.new_save_id()
    results, fs_results = [], []
    for r, plan in enumerate(plans):
        name = sharded.data_file_name(sharded.rank_stem(r), writer._save_id)
        info = (name, 1 << 30, "0123456789abcdef")
        mine, theirs = [], []
        for item in plan.items:
            td = item.tensor_data
            assert td is not None
            nbytes = item.tensor_storage_size() or 0
            mine.append(WriteResult(item.index, nbytes, _Stored(file=name, key=key_path(item.index.fqn, None),
                                                                  shape=tuple(td.chunk.sizes), files=(info,))))
            theirs.append(WriteResult(item.index, nbytes, _StorageInfo(f"__{r}_0.distcp", 0, nbytes)))
        results.append(mine)
        fs_results.append(theirs)
    import time

    t0 = time.perf_counter()  # what the coordinator's finish does before it writes the index
    with memory.gc_paused():
        text = sharded.index_text(writer._index(metadata, results, None))
        sharded.parse_index(text, "tensorstore_h5.json").entries
    finish_s = time.perf_counter() - t0
    _last_index[0] = text
    fs_md = dict(vars(metadata))
    fs_md["storage_data"] = {wr.index: wr.storage_data for lst in fs_results for wr in lst}
    metadata.storage_data = fs_md["storage_data"]
    pickled = pickle.dumps(metadata)
    t0 = time.perf_counter()
    pickle.loads(pickled)  # what FileSystemReader.read_metadata does on every rank
    unpickle_s = time.perf_counter() - t0
    return {"ranks": ranks, "index_bytes": len(text), "dcp_metadata_bytes": len(pickled),
            "pieces": sum(len(p.items) for p in plans), "finish_s": finish_s, "dcp_metadata_read_s": unpickle_s}


def llama_shapes(layers: int = 32, width: int = 4096, hidden: int = 11008, vocab: int = 32000,
                 optimizer: bool = True) -> dict[str, tuple[int, ...]]:
    """DCP keys -> shapes of a Llama-2-7B-like model (and its AdamW moments): the state dict
    :func:`index_scaling` measures."""
    model: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, width)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            model[p + f"self_attn.{name}.weight"] = (width, width)
        model[p + "mlp.gate_proj.weight"] = (hidden, width)
        model[p + "mlp.up_proj.weight"] = (hidden, width)
        model[p + "mlp.down_proj.weight"] = (width, hidden)
        model[p + "input_layernorm.weight"] = (width,)
        model[p + "post_attention_layernorm.weight"] = (width,)
    model["model.norm.weight"] = (width,)
    model["lm_head.weight"] = (vocab, width)
    out = {f"model.{k}": v for k, v in model.items()}
    if optimizer:
        for k, v in model.items():
            out[f"optim.state.{k}.exp_avg"] = v
            out[f"optim.state.{k}.exp_avg_sq"] = v
    return out


def index_scaling(shapes: Mapping[str, tuple[int, ...]], ranks: tuple[int, ...] = (2, 8, 64, 512)) -> list[dict[str, Any]]:
    """For each number of ranks: the index's bytes (in all and per rank), the bytes of the pickled
    metadata DCP's FileSystemWriter writes for the same save, the seconds the coordinator spends
    building and checking the index (``finish_s``) and the seconds one rank spends reading it
    (``read_s``: parse, check every entry and its pieces, build DCP's Metadata)."""
    import time

    from ..distributed.backend import dcp_metadata

    rows = []
    for n in ranks:
        t0 = time.perf_counter()
        size = index_size(shapes, n)
        built = time.perf_counter() - t0
        text = _last_index[0]
        t0 = time.perf_counter()
        layout = sharded.parse_index(text, "tensorstore_h5.json")
        dcp_metadata(layout, "ckpt")
        read = time.perf_counter() - t0
        rows.append(dict(size, index_bytes_per_rank=size["index_bytes"] / n, simulated_s=built, read_s=read))
    return rows


_last_index: list[bytes] = [b""]
