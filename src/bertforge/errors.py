"""The one exception type for mistakes a user can make: the CLI prints its message on one line and exits 2. And how
the CLI reports every failure: one line where it can say what went wrong, a traceback where it cannot."""

import errno
import os
import re
import sys
import traceback


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


def report(e: BaseException, multiprocess: bool) -> tuple[int, bool]:
    """The exit code for `e`, after its line (or traceback) on stderr, and whether the process leaves at once; called
    while `e` is handled, it re-raises what no line describes in a single-process run."""
    if isinstance(e, UserError):
        # One line, whatever the message quotes from the input (a column name may hold a newline or U+2028).
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in str(e))
        print(f"error: {text}", file=sys.stderr)
        return 2, isinstance(e, StorageError)
    if isinstance(e, OSError) and (refused := storage_problem(e)) is not None:
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{refused[0]}; {refused[1]} and run the same command again", file=sys.stderr)
        return 2, False
    if isinstance(e, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        return 130, False
    if not multiprocess or isinstance(e, OSError):
        raise e
    lost = failed_collective(e)
    if lost is None:
        traceback.print_exc()
    else:
        import jax

        print(f"error: process {jax.process_index()} of {jax.process_count()}: a collective with the other processes "
              f"failed ({lost}); another process has probably stopped, its log says why. Run the same command again "
              "on every process to continue from the last checkpoint", file=sys.stderr)  # fmt: skip
    return 1, False
