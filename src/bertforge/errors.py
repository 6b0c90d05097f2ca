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
    code = e.errno if isinstance(e, OSError) else None
    if code is None and (match := re.search(r"os_error_code='(\d+)'", str(e))):
        code = int(match.group(1))
    return (os.strerror(code), _STORAGE_REMEDIES[code]) if code in _STORAGE_REMEDIES else None
