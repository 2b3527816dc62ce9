"""The import paths of modules that moved into the wings, kept for code that used them.

``tensorstore_h5.store``, ``tensorstore_h5.writer``, ``tensorstore_h5.remote`` and the rest of
the flat layout before docs/ARCHITECTURE.md still import: each is the very module object of its
new home (so ``th5.remote.FETCH_AHEAD = 8`` sets the setting the library reads).
``tensorstore_h5.io``, which was split into ``storage.files``, ``storage.memory``,
``storage.parallel`` and ``storage.libhdf5``, is a module whose attributes are read from and
written to the module that now owns each name. (The benchmark's former modules,
``tensorstore_h5.bench_*``, are not kept: ``tensorstore-h5 bench`` is their interface.)

The package's finder (``tensorstore_h5._FormerPaths``, last on ``sys.meta_path``) is consulted
only after the regular import system found no such file, and imports this module only then,
so it costs nothing on the library's own imports nor on ``import tensorstore_h5``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import types
from collections.abc import Callable
from typing import Any

MOVED: dict[str, str] = {
    "tensorstore_h5.constants": "tensorstore_h5.format.constants",
    "tensorstore_h5.dtypes": "tensorstore_h5.format.dtypes",
    "tensorstore_h5.tree": "tensorstore_h5.format.tree",
    "tensorstore_h5.checksum": "tensorstore_h5.format.checksum",
    "tensorstore_h5.slicing": "tensorstore_h5.format.slicing",
    "tensorstore_h5.hdf5meta": "tensorstore_h5.format.hdf5meta",
    "tensorstore_h5.remote": "tensorstore_h5.storage.remote",
    "tensorstore_h5.httpranges": "tensorstore_h5.storage.httpranges",
    "tensorstore_h5.hdf5source": "tensorstore_h5.storage.libhdf5",
    "tensorstore_h5.compression": "tensorstore_h5.codecs.presets",
    "tensorstore_h5.select": "tensorstore_h5.reading.select",
    "tensorstore_h5.store": "tensorstore_h5.reading.store",
    "tensorstore_h5.writer": "tensorstore_h5.writing.writer",
    "tensorstore_h5.background": "tensorstore_h5.writing.background",
    "tensorstore_h5.synthetic": "tensorstore_h5.bench.synthetic",
    "tensorstore_h5.loopback": "tensorstore_h5.bench.loopback",
    "tensorstore_h5.realweights": "tensorstore_h5.bench.realweights",
    "tensorstore_h5.distributed.simulate": "tensorstore_h5.bench.simulate",
}
"""Old module path -> the module that is now at its place."""

SPLIT: dict[str, tuple[str, ...]] = {
    "tensorstore_h5.io": ("tensorstore_h5.storage.files", "tensorstore_h5.storage.memory",
                          "tensorstore_h5.storage.parallel", "tensorstore_h5.storage.libhdf5"),
}
"""Old module path -> the modules its names went to (looked up in this order)."""


class SplitModule(types.ModuleType):
    """A module whose attributes live in ``homes``: reading one reads it from the first home
    that has it, setting one sets it there (the home's code reads its own global)."""

    def __init__(self, name: str, homes: tuple[str, ...]) -> None:
        super().__init__(name, f"Moved: the names of this module are now in {', '.join(homes)}.")
        object.__setattr__(self, "_homes", homes)

    def _home(self, attr: str) -> types.ModuleType | None:
        for home in object.__getattribute__(self, "_homes"):
            module = importlib.import_module(home)
            if attr in vars(module):
                return module
        return None

    def __getattr__(self, attr: str) -> Any:
        home = self._home(attr)
        if home is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        return getattr(home, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        home = None if attr.startswith("__") else self._home(attr)
        if home is None:
            object.__setattr__(self, attr, value)
        else:
            setattr(home, attr, value)

    def __dir__(self) -> list[str]:
        return sorted({n for h in object.__getattribute__(self, "_homes") for n in vars(importlib.import_module(h))})


class _Finder:
    """Finds and loads the old paths (a meta path finder and its loader)."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}  # old path -> the module's own spec

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name in MOVED or name in SPLIT:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name in SPLIT:
            return SplitModule(spec.name, SPLIT[spec.name])
        module = importlib.import_module(MOVED[spec.name])  # the same object: its settings are the library's
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        own = self._specs.pop(module.__spec__.name, None)
        if own is not None:  # the import system gave the module the old path's spec: its own again,
            module.__spec__ = own  # or the relative imports inside its functions would warn


_FINDER = _Finder()


def find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of ``name`` when it is a module path of the flat layout, else None (what the
    package's meta path finder asks, after no module of that name was found)."""
    return _FINDER.find_spec(name, None)


def former_module(package: str, home: str, submodules: frozenset[str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the package ``package``, which took the place of a module
    of that name whose names now live in its submodule ``home``: ``package.NAME`` is
    ``package.home.NAME`` (imported on first use). Raises AttributeError for other names and
    for the package's ``submodules`` (which the import system imports itself)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__") or name in submodules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            return getattr(importlib.import_module(f"{package}.{home}"), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
