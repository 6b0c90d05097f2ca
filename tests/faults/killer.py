"""Run a bertforge command and SIGKILL it at a chosen moment (the command is run in this process, so the kill
lands in bertforge's own code, in the middle of whatever it was doing).

    python killer.py after:MODULE:ATTR:N:DELAY -- ARGS...   the Nth call of MODULE.ATTR (ATTR may be Class.method)
                                                          arms a timer that kills the process DELAY seconds later
                                                          (0: at once, before the call runs)
    python killer.py inside:MODULE:ATTR:K -- ARGS...        kill at the Kth function call (Python or C) made during the
                                                          first call of MODULE.ATTR, in its thread
    python killer.py count:MODULE:ATTR -- ARGS...           run normally and print how many calls that call made
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import threading


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _patch(module_name: str, attr: str, make):  # make(original) -> replacement
    owner = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    setattr(owner, name, make(original))


def after(original, n: int, delay: float):
    calls = [0]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            if delay <= 0:
                _die()
            threading.Timer(delay, _die).start()
        return original(*args, **kwargs)

    return wrapper


def inside(original, k: int | None):
    events = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            events[0] += 1
            if events[0] == k:
                _die()

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        sys.setprofile(profile)
        try:
            return original(*args, **kwargs)
        finally:
            sys.setprofile(None)
            if k is None:
                print(f"calls: {events[0]}", file=sys.stderr)

    return wrapper


def main() -> int:
    spec, sep, *args = sys.argv[1:]
    assert sep == "--", __doc__
    how, module_name, attr, *rest = spec.split(":")
    if how == "after":
        _patch(module_name, attr, lambda f: after(f, int(rest[0]), float(rest[1])))
    elif how == "inside":
        _patch(module_name, attr, lambda f: inside(f, int(rest[0])))
    elif how == "count":
        _patch(module_name, attr, lambda f: inside(f, None))
    else:
        raise SystemExit(__doc__)
    from bertforge.cli import main as cli

    return cli(args)


if __name__ == "__main__":
    sys.exit(main())
