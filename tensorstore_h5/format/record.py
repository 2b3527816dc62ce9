"""Frozen record classes, as ``@dataclass(frozen=True)`` makes them, for a fraction of its cost
at import.

``dataclass`` compiles each generated method from source (``exec``): ~0.5 ms a frozen class,
and the format's dozen records were ~6 ms of a fresh process's first ``th5.open`` (about a
quarter of it; issue #29). :func:`record` builds the same methods from closures over the
field names, compiling nothing: ``__init__`` (unless the class writes its own, as the records
made by the thousand do, to set ``__dict__`` in one call), ``__repr__``, ``__eq__``,
``__hash__``, ``__match_args__``, and assignment and deletion refused (:class:`FrozenError`).

Fields are the class's own annotations, after its record bases' fields, but names starting
with ``_`` (private state a custom ``__init__`` sets, left out of the repr and comparisons).
A class attribute of a field's name is its default. Instances keep a ``__dict__``, so
``functools.cached_property`` works on them.
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["record", "FrozenError"]

T = TypeVar("T", bound=type)


class FrozenError(AttributeError):
    """Raised on assignment to or deletion of a record's attribute (as dataclasses'
    ``FrozenInstanceError``, an AttributeError)."""


def record(cls: T) -> T:
    """Make ``cls`` a frozen record (see the module docstring); returns ``cls``."""
    inherited: tuple[str, ...] = ()
    for base in reversed(cls.__mro__[1:]):
        inherited += tuple(n for n in getattr(base, "_record_fields", ()) if n not in inherited)
    own = tuple(n for n in cls.__dict__.get("__annotations__", {}) if not n.startswith("_") and n not in inherited)
    names = inherited + own
    defaults = {n: getattr(cls, n) for n in names if hasattr(cls, n)}
    qualname = cls.__qualname__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(names):
            raise TypeError(f"{qualname}() takes {len(names)} arguments, {len(args)} given")
        values = dict(defaults)
        values.update(zip(names, args))
        for k, v in kwargs.items():
            if k not in defaults and k not in names or k in names[:len(args)]:
                raise TypeError(f"{qualname}() got an unexpected or repeated argument {k!r}")
            values[k] = v
        missing = [n for n in names if n not in values]
        if missing:
            raise TypeError(f"{qualname}() missing arguments: {', '.join(missing)}")
        self.__dict__.update(values)

    def __repr__(self: Any) -> str:
        d = self.__dict__
        return f"{qualname}(" + ", ".join(f"{n}={d.get(n)!r}" for n in names) + ")"

    def __eq__(self: Any, other: Any) -> Any:
        if other.__class__ is not self.__class__:
            return NotImplemented
        a, b = self.__dict__, other.__dict__
        return all(a.get(n) == b.get(n) for n in names)

    def __hash__(self: Any) -> int:
        d = self.__dict__
        return hash(tuple(d.get(n) for n in names))

    def __setattr__(self: Any, name: str, value: Any) -> None:
        raise FrozenError(f"cannot assign to field {name!r} of a frozen {qualname}")

    def __delattr__(self: Any, name: str) -> None:
        raise FrozenError(f"cannot delete field {name!r} of a frozen {qualname}")

    methods = {"__repr__": __repr__, "__eq__": __eq__, "__hash__": __hash__, "__setattr__": __setattr__,
               "__delattr__": __delattr__}
    if "__init__" not in cls.__dict__:
        methods["__init__"] = __init__
    for name, fn in methods.items():
        fn.__qualname__ = f"{qualname}.{name}"
        setattr(cls, name, fn)
    cls._record_fields = names  # type: ignore[attr-defined]
    cls.__match_args__ = names  # type: ignore[attr-defined]
    return cls
