"""``select=``: which leaves of a file to load, from a glob, a list of keys/globs, or a callable."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterable, Sequence
from typing import Union

from ..errors import KeyNotFoundError

__all__ = ["Selector", "resolve", "is_pattern", "closest"]

Selector = Union[None, str, Sequence[str], Callable[[str], bool]]

_GLOB = frozenset("*?[")


def is_pattern(s: str) -> bool:
    """True when ``s`` holds glob characters (``*``, ``?``, ``[``)."""
    return any(c in _GLOB for c in s)


def closest(key: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` candidates that look most like ``key``."""
    return difflib.get_close_matches(key, list(candidates), n=n, cutoff=0.5)


def resolve(selector: Selector, leaves: Sequence[str], containers: Sequence[str], file: str) -> set[str]:
    """The key paths to include: selected leaves, their ancestor containers, and selected
    containers with everything beneath them.

    Globs (fnmatch: ``*`` also matches ``/``) match leaf and container paths; an exact key
    names a leaf or a container. Raises KeyNotFoundError (a KeyError) for an exact key that
    is not in the file, naming the closest keys.
    """
    if selector is None:
        return {"", *leaves, *containers}
    if callable(selector):
        chosen = {p for p in leaves if selector(p)}
        matched_containers: set[str] = set()
    else:
        patterns = [selector] if isinstance(selector, str) else list(selector)
        if not all(isinstance(p, str) for p in patterns):
            raise TypeError("select must be a glob, a list of keys or globs, or a callable on the key path")
        leaf_set, container_set = set(leaves), set(containers)
        chosen, matched_containers = set(), set()
        for pat in patterns:
            if is_pattern(pat):
                chosen.update(fnmatch.filter(leaves, pat))
                matched_containers.update(fnmatch.filter(containers, pat))
            elif pat in leaf_set:
                chosen.add(pat)
            elif pat in container_set:
                matched_containers.add(pat)
            else:
                near = closest(pat, [*leaves, *containers])
                hint = f"; closest keys: {', '.join(map(repr, near))}" if near else ""
                raise KeyNotFoundError(f"{file}: no key {pat!r}{hint}")
    if matched_containers:
        for p in [*leaves, *containers]:
            if any(p.startswith(c + "/") or not c for c in matched_containers):
                chosen.add(p)
        chosen |= matched_containers
    included = set(chosen)
    for p in chosen:
        while p:
            p = p.rpartition("/")[0]
            if p in included:
                break
            included.add(p)
    included.add("")
    return included
