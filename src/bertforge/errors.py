"""The one exception type for mistakes a user can make: the CLI prints its message on one line and exits 2."""

import errno
import os
import re


class UserError(Exception):
    """Bad input, named precisely (file, row, column or config key); never shown with a traceback."""


class StorageError(UserError):
    """A write the disk refused (full, over quota, read-only). Background writers may still be failing, so the
    command leaves at once after saying so."""


# What a refused write asks of the user: room for the full-disk kinds, write access for the others.
_STORAGE_REMEDIES = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space",
    errno.EFBIG: "free space",
    errno.EROFS: "make it writable",
    errno.EACCES: "make it writable",
}


def storage_problem(e: BaseException) -> tuple[str, str] | None:
    """('No space left on device', 'free space') and the like when `e` is a refused write (an OSError, or an
    error of tensorstore, which orbax writes through, carrying os_error_code), else None."""
    code = e.errno if isinstance(e, OSError) else _quoted_error_code(str(e))
    return (os.strerror(code), _STORAGE_REMEDIES[code]) if code in _STORAGE_REMEDIES else None


def mentions_storage_problem(text: str) -> bool:
    """Whether a log line quotes a refused write, as tensorstore words it."""
    return _quoted_error_code(text) in _STORAGE_REMEDIES


def _quoted_error_code(text: str) -> int | None:
    match = re.search(r"os_error_code='(\d+)'", text)
    return int(match.group(1)) if match else None


# How the cross-process collectives (Gloo on CPU, NCCL on GPU) word a peer that went away mid-exchange.
_COLLECTIVE_FAILURES = re.compile(r"Gloo|NCCL|collective mismatch|Connection closed by peer|Connection reset by peer")


def failed_collective(e: BaseException) -> str | None:
    """`e`'s message on one line when it is a collective between processes that failed (as when another process
    died mid-step), else None."""
    text = str(e)
    return " ".join(text.split()) if _COLLECTIVE_FAILURES.search(text) else None
