"""Exception and warning classes of tensorstore_h5.

Every error raised on purpose by the library derives from :class:`TensorStoreError`
and also from the built-in exception a caller would expect (``ValueError``,
``TypeError``, ``KeyError``), so ``except KeyError`` keeps working.
"""

from __future__ import annotations

import os

__all__ = [
    "TensorStoreError",
    "FormatError",
    "UnsupportedTypeError",
    "KeyNotFoundError",
    "MismatchError",
    "WriteError",
    "PathError",
    "MissingFileError",
    "FileAccessError",
    "NotRegularFileError",
    "InvalidPathError",
    "TensorStoreWarning",
    "RemoteError",
    "DecodeError",
    "NAMED_KEYS",
    "few",
]

NAMED_KEYS = 5
"""Error messages name at most this many keys, then say how many more."""


def few(items: list[str]) -> str:
    """At most :data:`NAMED_KEYS` items (already formatted), then how many more."""
    shown = ", ".join(items[:NAMED_KEYS])
    return shown + (f" and {len(items) - NAMED_KEYS} more" if len(items) > NAMED_KEYS else "")


class TensorStoreError(Exception):
    """Base class of every error that tensorstore_h5 raises on purpose."""


class FormatError(TensorStoreError, ValueError):
    """A file is not a readable tensorstore_h5/HDF5 file: not HDF5, of a newer format
    version, truncated, or with damaged layout attributes. The message names the file
    and, where it applies, the key."""


class UnsupportedTypeError(TensorStoreError, TypeError):
    """A value cannot be stored without pickle (the message names the key path and type)."""


class KeyNotFoundError(TensorStoreError, KeyError):
    """A requested key path is not in the file; the message names the closest keys."""

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class MismatchError(TensorStoreError, ValueError):
    """A target tensor's shape, dtype or device does not fit the stored tensor."""


class WriteError(TensorStoreError, OSError):
    """A file cannot be written (disk full, I/O error): the save was abandoned and any
    earlier file at the path is unchanged. The message names the file and the key."""


class PathError(TensorStoreError, OSError):
    """A path the library was asked to read from cannot be read as a file: missing, not
    permitted, not a regular file, or not a valid path. The message names the path;
    ``filename`` is the path and ``errno`` the error number, where there is one. The
    subclasses are also the built-in exception a caller would catch."""

    def __init__(self, message: str, filename: str | None = None, error: int | None = None) -> None:
        super().__init__(message)
        self.filename = filename
        self.errno = error
        self.strerror = os.strerror(error) if error is not None else None

    def __str__(self) -> str:  # OSError would format errno and filename instead of the message
        return str(self.args[0]) if self.args else ""


class MissingFileError(PathError, FileNotFoundError):
    """No file at the path (or a symlink to nothing)."""


class FileAccessError(PathError, PermissionError):
    """The file exists but this process may not read it."""


class NotRegularFileError(PathError, FormatError):
    """The path names a directory, FIFO, device or socket (itself or through a symlink), which
    is never opened for reading, or refused right after the open if swapped in meanwhile."""


class InvalidPathError(PathError, ValueError):
    """The path cannot name a file (it holds a NUL character)."""


class RemoteError(TensorStoreError, OSError):
    """A remote object could not be read or written: the message names the URL (raised by
    ``storage.remote``; defined here so that readers catch it without importing that)."""


class DecodeError(Exception):
    """A chunk that does not decode to exactly its bytes (damaged or hostile): raised by the
    decoders (``codecs.decoders``, which also name it), caught by readers as a damaged file;
    defined here so that a reader catches it without importing the codecs wing."""


class TensorStoreWarning(UserWarning):
    """Warnings issued by tensorstore_h5."""
