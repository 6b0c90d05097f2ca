"""Writing files so that a reader sees them whole or not at all."""

from __future__ import annotations

import errno
import glob
import json
import math
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bertforge.errors import UserError

_UMASK = os.umask(0)
os.umask(_UMASK)

# Payloads of at least DIRECT_MIN bytes (model weights, vectors) go to the disk past the page cache (O_DIRECT) where
# the filesystem takes it: they are fsynced anyway, and copying them into fresh page-cache pages first is most of a
# model folder's write time on some machines (docs/benchmarks.md). O_DIRECT moves whole blocks from an aligned
# buffer, ALIGN bytes covering both logical block sizes disks use (512 and 4096); the tail goes through the cache.
DIRECT_MIN = 4 << 20
ALIGN = 4096
CHUNK = 8 << 20


def _remove_leftovers(path: Path) -> None:
    """Temporary files or folders of earlier writes of `path` that a kill interrupted."""
    for old in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it."""
    path = Path(path)
    _remove_leftovers(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)  # as open() would create it; mkstemp makes it private
            _write_synced(fd, data.encode("utf-8") if isinstance(data, str) else data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:  # name the file a full disk refused
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def _write_synced(fd: int, data: bytes) -> None:
    """All of `data` into the empty file `fd`, its whole blocks past the page cache when it is large, then fsync."""
    view = memoryview(data).cast("B")
    done = _write_direct(fd, view) if view.nbytes >= DIRECT_MIN else 0
    _write_all(fd, view[done:])
    os.fsync(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _write_direct(fd: int, data: memoryview) -> int:
    """Write data's whole ALIGN-byte blocks to `fd` (at offset 0) with O_DIRECT; how many bytes were written: 0
    where the system or the filesystem refuses O_DIRECT, fewer than the blocks where a write refuses it midway."""
    whole = data.nbytes - data.nbytes % ALIGN
    direct = getattr(os, "O_DIRECT", 0)
    if not whole or not direct:
        return 0
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | direct)
    except OSError:
        return 0
    done = 0
    try:
        # mmap's memory is page-aligned; left to be unmapped with its last view (an error's frames may hold one)
        aligned = memoryview(mmap.mmap(-1, min(CHUNK, whole)))
        while done < whole:
            n = min(CHUNK, whole - done)
            aligned[:n] = data[done : done + n]
            _write_all(fd, aligned[:n])  # after a short write the kernel refuses an unaligned offset: EINVAL
            done += n
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    os.lseek(fd, done, os.SEEK_SET)
    return done


def write_atomic_fs(fs: Any, path: str, data: bytes) -> None:
    """Write to a temporary name beside `path` on any fsspec filesystem, then rename it to `path`; on a local disk
    by write_atomic, which also fsyncs it (a rename can otherwise reach the disk before the data it names)."""
    if "file" in _protocols(fs):
        write_atomic(path, data)
        return
    parent, slash, name = path.rpartition("/")
    tmp = f"{parent}{slash}.{name}.tmp"
    with fs.open(tmp, "wb") as fh:
        fh.write(data)
    fs.mv(tmp, path)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def temp_folder_beside(path: Path) -> Path:
    """A new empty folder next to `path`, with the permissions mkdir would give (mkdtemp makes it private)."""
    _remove_leftovers(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o777 & ~_UMASK)
    return tmp


def move_into(tmp: Path, out: Path) -> None:
    """Move the whole folder `tmp` to `out`, or, where `out` exists, each of its entries into it (a subfolder
    replacing the one of its name), with out's config.json taken away first and put back last: a reader of `out`
    never takes a folder whose files are half replaced for a whole one (transformers reads config.json first)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    (out / "config.json").unlink(missing_ok=True)
    for entry in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
        target = out / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)  # os.replace moves a folder only onto an empty one
        elif target.exists() and entry.is_dir():
            target.unlink()
        os.replace(entry, target)
    tmp.rmdir()


def fill_folder_into(out: Path, fill: Callable[[Path], None]) -> None:
    """Let `fill` write a temporary folder beside `out`, then move it into `out` (move_into): a crash leaves `out`
    as it was, and its other files stay."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder_beside(out)
    try:
        fill(tmp)
        move_into(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def copy_folder_into(source: Path, out: Path) -> None:
    """Copy the folder `source` to `out` through a temporary folder beside it (fill_folder_into)."""
    fill_folder_into(out, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True))


def write_folder_atomic(path: str | Path, fill: Callable[[Path], None]) -> None:
    """Let `fill` write a temporary folder beside `path`, then rename it to `path` (replacing what was there)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder_beside(path)
    try:
        fill(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A JSON file holding an object; anything else is a UserError naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path}: not valid JSON") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def finite_json(obj: Any, indent: int | None = None) -> str:
    """json.dumps of `obj` with every non-finite float written as null: strict JSON, which has no NaN or Infinity
    (parsers outside Python refuse them). Where a number goes, bertforge's readers take null back as NaN
    (nan_for_null)."""
    return json.dumps(finite(obj), indent=indent, allow_nan=False)


def finite(obj: Any) -> Any:
    """`obj` (a number, or lists and objects of them) with every non-finite float as None (JSON's null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def nan_for_null(obj: Any) -> Any:
    """finite_json's numbers read back: every null in `obj` (a number, or lists and objects of numbers) as NaN."""
    if obj is None:
        return math.nan
    if isinstance(obj, dict):
        return {k: nan_for_null(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [nan_for_null(v) for v in obj]
    return obj
