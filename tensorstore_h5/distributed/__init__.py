"""tensorstore_h5 as a storage backend of ``torch.distributed.checkpoint`` (DCP).

DCP plans which rank writes what, deduplicates replicated tensors and reshards on load; this
package only stores: each rank writes one ordinary tensorstore_h5 file (format 2, written with
:class:`tensorstore_h5.Writer`), and the coordinator writes the directory index
``tensorstore_h5.json`` last, atomically, as JSON (docs/FORMAT.md, "Sharded checkpoints
(directories)"; docs/DISTRIBUTED.md).

    import torch.distributed.checkpoint as dcp
    from tensorstore_h5.distributed import H5StorageWriter, H5StorageReader

    dcp.save(state_dict, storage_writer=H5StorageWriter("ckpt/step100", compression="lz4"))
    dcp.load(state_dict, storage_reader=H5StorageReader("ckpt/step100"))

``torch.distributed`` is imported when one of these names is first used, not by
``import tensorstore_h5`` nor by ``import tensorstore_h5.distributed``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["H5StorageWriter", "H5StorageReader", "save", "load"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
