"""Where bytes come from and go: local files (:mod:`.files`: preadv, pwrite, O_DIRECT, mappings),
host memory for tensors (:mod:`.memory`), the I/O threads and read plans (:mod:`.parallel`),
URLs and file objects (:mod:`.remote`, over the client :mod:`.httpranges`), and files that
only libhdf5 reads (:mod:`.libhdf5`). Importing this package imports none of them.
"""

from __future__ import annotations

import importlib
from typing import Any


class Deferred:
    """Stands for a module until its first attribute is asked for: then imports it and puts
    it in place of itself under ``name`` in ``namespace`` (a module's globals), so later uses
    are plain attribute lookups. For modules that most calls of their importer do not need
    (libhdf5 or the remote client when a local format-2 file is read: the first open in a
    fresh process pays for every import)."""

    def __init__(self, module: str, namespace: dict[str, Any], name: str) -> None:
        self.__dict__.update(_module=module, _namespace=namespace, _name=name)

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._module)
        self._namespace[self._name] = module
        return getattr(module, attr)
