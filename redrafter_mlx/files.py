"""Writing files so that a process killed at any moment, or a disk that
fills, never leaves a half-written one under its real name.

Every file a long job keeps is written beside its final name (a hidden
temporary in the same folder), flushed to the disk, and renamed into place;
the folder is flushed too, so that the rename itself survives a crash. A
rename within one file system is atomic: a reader sees the old file or the
new one, never a part of either. A failed write (no space, a read-only
folder, no permission) removes its temporary and raises one ``UserError``
that names the path, the space the write needed and the space there was.
"""

import errno
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from .errors import UserError

TEMPORARY_MARK = ".partial"  # in every temporary's name: ".NAME.partial-PID"


def temporary_beside(path: Path) -> Path:
    """A temporary name in ``path``'s folder, hidden, unique to this process."""
    return path.with_name(f".{path.name}{TEMPORARY_MARK}-{os.getpid()}")


def is_temporary(path: Path) -> bool:
    return path.name.startswith(".") and TEMPORARY_MARK in path.name


def sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename into it) to the disk."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # a platform without folder descriptors
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def sync_tree(path: Path) -> None:
    """Flush a file, or every file in a folder, to the disk."""
    for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb+") as f:
            os.fsync(f.fileno())
    if path.is_dir():
        sync_folder(path)


def failure(path: Path, error: BaseException, needed: Optional[int] = None, keeps: str = "") -> UserError:
    """The one error line of a write that failed: the path, why, and for a
    full disk the space needed and the space free. ``keeps``: what is left
    intact, and how to go on (say, "run the same command again to resume")."""
    reason = getattr(error, "strerror", None) or str(error)
    free, text = free_bytes(path.parent), str(error).lower()
    # Some writers (MLX's, NumPy's) say only that a write fell short: one
    # that needs more than is free is taken for a full disk.
    full = (
        getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        or "no space" in text
        or (needed is not None and needed > free)
    )
    if full:
        reason = "the disk is full"
        if needed is not None:
            reason += f": it needs about {size_text(needed)} and {size_text(free)} is free"
        else:
            reason += f" ({size_text(free)} free)"
    return UserError(f"cannot write {path} ({reason})" + (f"; {keeps}" if keeps else ""))


def free_bytes(folder: Path) -> int:
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return 0


def size_text(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


@contextmanager
def replacing(path, needed: Optional[int] = None, keeps: str = "") -> Iterator[Path]:
    """``with replacing(path) as temporary:`` write the file (or folder) at
    ``temporary``; on leaving the block it is flushed and renamed to
    ``path`` (replacing a file, or an empty folder, of that name). On an
    error nothing is left but what was there before. MLX's writers raise
    ``RuntimeError`` where Python's raise ``OSError``: both are turned into
    one ``UserError`` (``failure``)."""
    path = Path(path)
    temporary = temporary_beside(path)
    remove(temporary)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield temporary
        sync_tree(temporary)
        os.replace(temporary, path)
        sync_folder(path.parent)
    except (OSError, RuntimeError) as e:
        remove(temporary)
        if isinstance(e, RuntimeError) and not _is_io_error(e):
            raise
        raise failure(path, e, needed, keeps) from None
    except BaseException:
        remove(temporary)
        raise


def _is_io_error(error: RuntimeError) -> bool:
    text = str(error).lower()
    return any(
        word in text
        for word in ("no space", "cannot open", "failed to open", "could not open", "write", "permission", "read-only")
    )


def write_text(path, text: str, keeps: str = "") -> None:
    """Replace the text file ``path`` with ``text`` (UTF-8), atomically."""
    data = text.encode("utf-8")
    with replacing(path, len(data), keeps) as temporary:
        temporary.write_bytes(data)


def write_json(path, value, keeps: str = "") -> None:
    write_text(path, json.dumps(value, indent=1) + "\n", keeps)


def write_with(path, write: Callable[[Path], None], needed: Optional[int] = None, keeps: str = "") -> None:
    """Replace ``path`` with what ``write(temporary path)`` writes, atomically."""
    with replacing(path, needed, keeps) as temporary:
        write(temporary)


def remove(path: Path) -> None:
    """Remove a file or a folder, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_temporaries(folder) -> None:
    """Remove what writes killed in this folder left (their temporaries)."""
    folder = Path(folder)
    if folder.is_dir():
        for path in folder.iterdir():
            if is_temporary(path):
                remove(path)
