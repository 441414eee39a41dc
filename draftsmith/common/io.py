"""Atomic, crash-safe file writes.

A file written here is either absent or complete: data goes to a temporary file in the same directory,
is fsync'ed, then renamed over the destination (rename is atomic on POSIX), and the directory is fsync'ed
so the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from draftsmith.common.dtypes import SAFETENSORS_CODES
from draftsmith.common.errors import DraftsmithError

LOCK_FILE_NAME = ".lock"  # what `dir_lock` leaves in a locked directory; emptiness checks should ignore it


@contextlib.contextmanager
def dir_lock(directory: str | os.PathLike, what: str = "job"):
    """Hold an exclusive lock on `directory` (created if absent) for the duration of the block.

    `with dir_lock(out_dir, what="capture"): ...` -- a second process asking for the same directory fails at
    once with the one-line DraftsmithError "OUT is in use by another draftsmith <what> (pid N)" instead of
    waiting or racing. The lock is `fcntl.flock` on DIR/.lock (`LOCK_FILE_NAME`), which holds the owner's pid;
    the kernel drops it when the process exits however it exits (kill -9 included), so a stale .lock file never
    blocks anyone and is left in place (deleting it would let two processes lock two different files).
    Not re-entrant: locking a directory the same process already holds fails like a second process would.
    On a filesystem without flock support the block runs unlocked.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise DraftsmithError(f"{directory}: exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DraftsmithError(f"{directory}: cannot create directory ({e.strerror or e})") from None
    lock_path = directory / LOCK_FILE_NAME
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise DraftsmithError(f"{lock_path}: cannot open lock file ({e.strerror or e})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                locked = False  # ENOLCK / EOPNOTSUPP (some network filesystems): no lock to be had
            else:
                try:
                    owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
                except OSError:
                    owner = "unknown"
                raise DraftsmithError(f"{directory} is in use by another draftsmith {what} (pid {owner})") from None
        if locked:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass  # the pid is only informative; the flock is the lock
        yield directory
    finally:
        os.close(fd)  # releases the flock


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_no_space(exc: BaseException) -> bool:
    """Whether `exc` is a full disk (or an exhausted quota): an OSError with that errno, or a library's own error
    (safetensors, torch.save, pyarrow) carrying the system's message for it."""
    if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
        return True
    if isinstance(exc, DraftsmithError):  # already a user-facing line
        return False
    if isinstance(exc, (OSError, RuntimeError, ValueError)) or type(exc).__name__.endswith("Error"):
        text = str(exc)
        return any(os.strerror(n) in text for n in NO_SPACE_ERRNOS)
    return False


def no_space_error(path: str | os.PathLike):
    """The one-line user error for a full disk while writing `path` (a DraftsmithError)."""
    return DraftsmithError(f"no space left on device: {path}")


class _FullWriter:
    """A binary file whose `write` writes everything or raises.

    An unbuffered `write` may write only part of its buffer (on a full disk, the part that fits) and return the
    count; ignoring it once committed truncated files. Here a short write is retried until the kernel raises the
    real error (ENOSPC) or takes everything, and a write of 0 bytes is treated as a full disk.
    """

    def __init__(self, raw):
        self._raw = raw

    def write(self, data) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        total, done = len(view), 0
        while done < total:
            n = self._raw.write(view[done:])
            if not n:
                raise OSError(errno.ENOSPC, "write() wrote nothing", self._raw.name)
            done += n
        return total

    def __getattr__(self, name):
        return getattr(self._raw, name)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a binary file; on success it is fsync'ed and renamed to `path`, else removed (nothing is renamed).

    Every `write` writes its whole buffer or raises. A full disk (ENOSPC/EDQUOT, at any write or at the fsync)
    is raised as the one-line DraftsmithError "no space left on device: PATH" after the temporary file is removed.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        with os.fdopen(fd, "wb", buffering=0) as f:
            yield _FullWriter(f)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if is_no_space(e):
            raise no_space_error(path) from None
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def atomic_save_file(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> str:
    """`safetensors.torch.save_file`, atomically. Returns the sha256 of the written bytes.

    Keep `metadata` to one key: safetensors writes it from a hash map, so several keys come out in a
    random order and identical content would not be byte-identical across processes.
    """
    if metadata and len(metadata) > 1:
        raise ValueError("atomic_save_file: give at most one metadata key (byte-reproducible output)")
    from safetensors.torch import save  # torch-free --help (the pipeline and stage CLIs import this module)

    data = save(tensors, metadata=metadata)
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """Read JSON with a one-line error naming the file on failure."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise DraftsmithError(f"{path}: {what} not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"{path}: {what} is not valid JSON ({e})") from None


_ST_DTYPES = SAFETENSORS_CODES  # torch dtype name -> safetensors header code (draftsmith.common.dtypes)


def atomic_save_safetensors_streaming(
    tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None, chunk: int = 1 << 26
) -> tuple[str, int]:
    """Write a safetensors file atomically without building it in memory; sha256 computed on the way.

    Same format as `safetensors.torch.save_file` (8-byte header length, JSON header padded to 8 bytes,
    raw little-endian tensor bytes in header order), readable by `safe_open`. Tensors are laid out by
    name, so the bytes are a deterministic function of the content. Returns (sha256, bytes written).
    """
    import torch  # torch-free --help (the pipeline and stage CLIs import this module)

    path = Path(path)
    names = sorted(tensors)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    views = []
    for name in names:
        t = tensors[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[str(t.dtype)],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        views.append(t.reshape(-1).view(torch.uint8).numpy() if nbytes else None)
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    head = len(hjson).to_bytes(8, "little") + hjson
    h = hashlib.sha256()
    with atomic_file(path) as f:
        f.write(head)
        h.update(head)
        for v in views:
            if v is None:
                continue
            mv = memoryview(v)
            for i in range(0, len(mv), chunk):
                part = mv[i : i + chunk]
                h.update(part)  # hashlib and write release the GIL on large buffers
                f.write(part)
    return h.hexdigest(), len(head) + offset
