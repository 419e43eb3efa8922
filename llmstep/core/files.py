"""Writing files so that nothing is ever left half-written, and output paths checked before the work starts.

A write goes to a temporary file in the destination's own directory, is flushed to the disk (fsync), and
is then renamed over the destination (`os.replace`, atomic on POSIX and Windows within one filesystem):
a reader, or a program interrupted at any point, sees the old file or the new one, complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "check_output_path",
           "fsync_dir"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename into it) to the disk, where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory; its renames are durable without this
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """`with atomic_write(p) as tmp:` write the file `tmp` (by any means: safetensors, a plain write); on leaving
    the block it replaces `p` in one rename. If the block raises, `p` is untouched and `tmp` is removed."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; give a file name to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)  # mkstemp makes files private (0600); a written file gets the usual mode
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _write_with(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    with atomic_write(path) as tmp:
        write(tmp)
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return _write_with(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return _write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike, obj, **dumps_kwargs) -> Path:
    """obj as indented JSON plus a newline (`dumps_kwargs` go to json.dumps, e.g. default=str)."""
    return atomic_write_text(path, json.dumps(obj, indent=2, **dumps_kwargs) + "\n")


def check_output_path(path: str | os.PathLike, what: str = "output") -> Path:
    """Refuse, before any work, an output path that cannot be written: a directory, a file whose parent is a file,
    or a directory that is not writable. The parent directory is created if missing. Returns the path."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} path {path} is a directory; give a file name")
    parent = path.parent
    for p in (parent, *parent.parents):
        if p.exists():
            if not p.is_dir():
                raise ValueError(f"{what} path {path}: {p} is a file, not a directory")
            break
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{what} path {path}: cannot create {parent} ({e.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{what} path {path}: {parent} is not writable")
    return path
