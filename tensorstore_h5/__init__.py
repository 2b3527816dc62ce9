"""tensorstore_h5: PyTorch checkpoints in HDF5 — selective, lazy, optionally compressed, never pickled.

    import tensorstore_h5 as th5
    th5.save({"model": model.state_dict(), "epoch": 3}, "ckpt.h5")
    with th5.open("ckpt.h5") as store:
        w = store["model/enc.weight"][:, :16]
    th5.load_into(model, "ckpt.h5", prefix="model/")
"""

from __future__ import annotations

from .api import LoadResult, load, load_into
from .compression import PRESETS
from .convert import convert
from .errors import (
    FormatError,
    KeyNotFoundError,
    MismatchError,
    TensorStoreError,
    TensorStoreWarning,
    UnsupportedTypeError,
    WriteError,
)
from .format import FORMAT_VERSION
from .store import Store, TensorHandle
from .store import open_store as open
from .tree import escape, unescape
from .writer import Writer, save

__version__ = "0.1.0"

__all__ = [
    "save", "load", "load_into", "open", "convert", "Store", "TensorHandle", "Writer", "LoadResult",
    "escape", "unescape", "PRESETS", "FORMAT_VERSION",
    "TensorStoreError", "FormatError", "UnsupportedTypeError", "KeyNotFoundError", "MismatchError", "WriteError",
    "TensorStoreWarning", "__version__",
]
