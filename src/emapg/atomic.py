"""Atomic writes: a temporary sibling (a file or a whole folder), flushed to disk, then renamed over
the target (atomic on POSIX). A kill at any moment leaves the old version or the new one, never a part
of either. Checkpoints, BM25 indexes, converted models, config.yaml, ``latest`` and eval tables all
go through here."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from emapg.errors import ConfigError

TMP, OLD = ".tmp-", ".old-"
"""Name parts of a folder being written and of one being replaced (``.NAME.tmp-PID-XXXX``)."""


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and an atomic rename: a kill leaves the old file
    or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a full disk: the old file stays, the partial one goes, the message names the file
        tmp.unlink(missing_ok=True)
        raise (write_error(e, path) or e) from None
    os.replace(tmp, path)


@contextlib.contextmanager
def naming_failed_writes(target: Path) -> Iterator[None]:
    """Inside, a failed write (a full disk: an OSError that names no file) is raised naming ``target``."""
    try:
        yield
    except OSError as e:
        raise (write_error(e, Path(target)) or e) from None


def append_line(path: Path, line: str) -> None:
    """Append one line to ``path`` (metrics, outcomes); a failed write (a full disk) names the file."""
    with naming_failed_writes(path), open(path, "a") as f:
        f.write(line + "\n")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` via a temporary file and an atomic rename."""
    write_text_atomic(path, json.dumps(data, indent=1))


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (the names of renamed files) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*"), reverse=True):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        elif p.is_dir():
            fsync_dir(p)
    fsync_dir(folder)


def sibling(target: Path, kind: str) -> Path:
    """A hidden sibling of ``target`` for this process: ``kind`` is :data:`TMP` or :data:`OLD`."""
    return target.with_name(f".{target.name}{kind}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_ours(path: Path) -> bool:
    """Whether a temporary or replaced sibling was made by this process (others' are debris of a kill)."""
    return f"-{os.getpid()}-" in path.name


def write_error(e: BaseException, target: Path) -> OSError | None:
    """A failure to write into ``target`` as an OSError that names it, when the original names no file: a
    full disk or a file-size limit inside numpy or bm25s (``OSError`` without a filename), or inside
    safetensors (its own ``SafetensorError`` carrying the OS error code). None for any other error."""
    if isinstance(e, OSError):
        if e.filename:
            return None
        return OSError(e.errno, e.strerror or f"a write was cut short (is the disk full?): {e}", str(target))
    if type(e).__name__ == "SafetensorError":
        code = re.search(r"(?:code: |os error )(\d+)", str(e))
        if code:
            number = int(code.group(1))
            return OSError(number, os.strerror(number), str(target))
        if "I/O error" in str(e) or "IoError" in str(e):
            return OSError(errno.EIO, str(e), str(target))
    return None


@contextlib.contextmanager
def folder_atomic(target: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling folder to fill; when the block ends it is flushed to disk and
    renamed to ``target``. An existing ``target`` is renamed aside first (put back if the rename
    fails) and removed only afterwards. On an exception the temporary folder is removed, and a write
    failure that names no file (a full disk) is raised as an OSError naming ``target``."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(target, TMP)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        old = None
        if target.exists():
            old = sibling(target, OLD)
            os.replace(target, old)
        try:
            os.replace(tmp, target)
        except BaseException:
            if old is not None:
                os.replace(old, target)
            raise
        fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        named = write_error(e, target)
        if named is not None:  # "No space left on device" alone does not say where
            raise named from e
        raise


def open_lock(path: Path):
    """``path`` opened to hold an OS lock on it (created when missing), never through a link: a lock file linked to
    another folder's would be written there (its holder's PID overwritten) before any check could refuse."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ConfigError(f"{path}: a link (to {os.readlink(path)}), not a lock file of its own: remove it "
                          "(nothing was changed)") from None
    return os.fdopen(fd, "a+")


@contextlib.contextmanager
def one_writer(target: Path, option: str = "--out") -> Iterator[None]:
    """This process as the one writer of ``target`` (a folder replaced whole at its end: an index) while the block
    runs: an exclusive OS lock on ``.NAME.emapg-lock`` beside it, released however the process ends. A second
    writer gets one line naming the holder's PID, before it writes anything (two builds into one folder both said
    they succeeded while the last rename won)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    real = target.resolve()  # the folder itself, however it is named: a link to it is the same folder
    lock = real.parent / f".{real.name}.emapg-lock"
    with open_lock(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise ConfigError(f"{option} {target}: another emapg (PID {f.read().strip() or 'unknown'}) is writing it; "
                              "one writer at a time (nothing was changed)") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
