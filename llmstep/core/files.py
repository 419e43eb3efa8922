"""Writing files so that nothing is ever left half-written, and output paths checked before the work starts.

A write goes to a temporary file in the destination's own directory, is flushed to the disk (fsync), and
is then renamed over the destination (`os.replace`, atomic on POSIX and Windows within one filesystem):
a reader, or a program interrupted at any point, sees the old file or the new one, complete.

A set of files that must change together (a checkpoint: config.json and its weights) is written whole into a
new sibling directory that then takes the old one's place (`replace_dir`): in one atomic exchange where the
system has one (Linux's renameat2), else in two renames undone if the second fails.

What an output path may be: a new name or an existing regular file. An existing target that is anything else (a
directory, a device such as /dev/null, a FIFO or `>(process substitution)`, a socket) is refused before any work
(`check_output_path`, which makes nothing: a write makes the missing directories, and removes them again if it
fails) and again by the write itself, so the rename never turns a device into a file. A symlink is
written through: the file it points to is replaced and the link stays a link (as `>` in a shell does). The
temporary file is removed when the write is interrupted by an exception, Ctrl-C, or SIGTERM (the CLI turns SIGTERM
into an exception so that this cleanup runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "strict_json",
           "check_output_path", "fsync_dir", "replace_dir", "default_mode", "write_target"]

_KINDS = ((stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (a named or anonymous pipe)"),
          (stat.S_ISSOCK, "a socket"))


def write_target(path: str | os.PathLike, what: str = "output") -> Path:
    """The path a write to `path` replaces: `path` itself, or, for a symlink, the file it points to (written
    through; a dangling link creates its target). Raises ValueError if that is an existing non-regular file."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode  # follows symlinks: /dev/fd/63 from >(jq .) is the pipe
    except (FileNotFoundError, NotADirectoryError):  # a new name (or one under a file, refused by the caller)
        mode = None
    except OSError as e:
        raise ValueError(f"{what} path {path}: cannot inspect it ({e.strerror})") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"{what} path {path} is a directory; give a file name")
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise ValueError(f"{what} path {path} is {kind}; llmstep writes only new or regular files "
                         f"(a write replaces the file, which would turn it into a regular file)")
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def default_mode(directory: bool = False) -> int:
    """The mode a new file (0o666) or directory (0o777) gets under this process's umask."""
    return (0o777 if directory else 0o666) & ~_umask()


def _umask() -> int:
    """This process's umask: read from /proc where Linux shows it, else set and put back (a moment in which another
    thread's new file would get mode 0o666, so only where nothing else can tell it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


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


def _missing_dirs(parent: Path) -> list[Path]:
    """The directories above a file that do not exist yet, outermost first."""
    return [p for p in reversed((parent, *parent.parents)) if not p.exists()]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """`with atomic_write(p) as tmp:` write the file `tmp` (by any means: safetensors, a plain write); on leaving
    the block it replaces `p` in one rename. If the block raises, `p` is untouched and `tmp` is removed, and so
    are the directories above `p` that the write created (only while they are empty)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; give a file name to write")
    path = write_target(path, "write")
    made = _missing_dirs(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        _remove_empty(made)
        raise OSError(e.errno, f"cannot write {path}: {e.strerror} (making a temporary file in {path.parent})"
                      ) from None
    os.close(fd)
    tmp = Path(name)
    done = False
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        tmp.chmod(default_mode())  # mkstemp makes files private (0600); a written file gets the usual mode
        os.replace(tmp, path)
        fsync_dir(path.parent)
        done = True
    finally:
        tmp.unlink(missing_ok=True)
        if not done:
            _remove_empty(made)


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the directories a failed write made, innermost first, each only if it is (still) empty."""
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:
            return


def _write_with(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    with atomic_write(path) as tmp:
        write(tmp)
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return _write_with(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return _write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def strict_json(obj):
    """obj with every float that is not finite (NaN, an infinity) turned into None, through dicts, lists and tuples:
    JSON has no NaN or Infinity (json.dumps writes them, and strict readers, jq and browsers among them, refuse
    the file), so a figure that has no value (a rate of nothing) is written as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict_json(v) for v in obj]
    return obj


def atomic_write_json(path: str | os.PathLike, obj, **dumps_kwargs) -> Path:
    """obj as indented, strict JSON plus a newline: a NaN or infinite float is written as null (`strict_json`).
    `dumps_kwargs` go to json.dumps (e.g. default=str); what `default` returns is refused if it is not finite."""
    text = json.dumps(strict_json(obj), indent=2, **{"allow_nan": False} | dumps_kwargs)
    return atomic_write_text(path, text + "\n")


def check_output_path(path: str | os.PathLike, what: str = "output") -> Path:
    """Refuse, before any work, an output path that cannot be written: a directory, a device, FIFO or socket, a
    file whose parent is a file, or a directory where no file can be made (read-only, /proc). Nothing is left
    behind: missing directories are not made here (the write makes them), and the probe file made in the nearest
    existing directory is removed at once. Returns the path (a symlink is written through, so its target's
    directory is the one checked). A path spelled with a trailing separator names a directory: refused too (Path
    would drop the separator and write a file of the directory's name)."""
    if os.fspath(path).endswith(("/", os.sep)):
        raise ValueError(f"{what} path {os.fspath(path)} ends in a separator, so names a directory: give a file name")
    path = Path(path)
    check_folder_writable(write_target(path, what).parent, f"{what} path {path}")
    return path


def check_folder_writable(folder: str | os.PathLike, what: str) -> None:
    """Refuse, before any work, a folder where no file can be made: the nearest existing folder at or above it a
    file, not writable, or refusing a probe file (a read-only mount as root, /proc). Nothing is left behind: missing
    folders are not made here (the write makes them), and the probe file is removed at once. `what` starts each
    message (the flag or setting that names the folder)."""
    folder = Path(folder)
    existing = next(p for p in (folder, *folder.parents, Path(".")) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{what}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: {existing} is not writable")
    try:
        fd, probe = tempfile.mkstemp(prefix=".llmstep.", suffix=".probe", dir=existing)
    except OSError as e:
        raise ValueError(f"{what}: cannot create a file in {existing} ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 with RENAME_EXCHANGE); False where unsupported."""
    if sys.platform != "linux":
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without it (glibc < 2.28, musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2  # <fcntl.h>, <linux/fs.h>
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # an old kernel, or a filesystem without it
        return False
    raise OSError(err, os.strerror(err), str(b))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # same filesystem: no bytes copied, and the old file stays as it was
    except OSError:
        shutil.copy2(src, dst)


def replace_dir(new: str | os.PathLike, path: str | os.PathLike, carry: Callable[[str], bool] = lambda name: True
                ) -> Path:
    """Make the complete directory `new` (a sibling of `path`) take `path`'s place; at every instant `path` is
    the old directory or the new one. Entries of the old directory that `new` lacks and `carry(name)` accepts
    are carried over first (hard links where possible). The old directory is then deleted. Returns `path`."""
    new, path = Path(new), Path(path)
    if path.is_symlink():
        path = path.resolve()
    if not path.exists():
        new.chmod(default_mode(directory=True))
        os.rename(new, path)
        fsync_dir(path.parent)
        return path
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is a file; give a directory to write the checkpoint into")
    for entry in path.iterdir():
        if not (new / entry.name).exists() and carry(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
            elif entry.is_symlink():
                os.symlink(os.readlink(entry), new / entry.name)
            else:
                _link_or_copy(str(entry), str(new / entry.name))
    new.chmod(path.stat().st_mode & 0o7777)
    if _exchange(new, path):  # `new` now holds the old directory
        old = new
    else:
        old = new.with_name(new.name + ".old")
        os.rename(path, old)
        try:
            os.rename(new, path)
        except BaseException:
            os.rename(old, path)  # put the old directory back
            raise
    fsync_dir(path.parent)
    shutil.rmtree(old)
    return path
