"""JAX's persistent compilation cache in a per-user folder: a command run again, or the next fold in a new process,
loads the programs it compiled before instead of compiling them again.

The folder is $BERTFORGE_COMPILE_CACHE, else $XDG_CACHE_HOME/bertforge/jax, else ~/.cache/bertforge/jax;
BERTFORGE_COMPILE_CACHE=off turns the cache off. Without BERTFORGE_COMPILE_CACHE, a folder the user gave JAX itself
(JAX_COMPILATION_CACHE_DIR, or jax_compilation_cache_dir set in the process) is kept, with JAX's own settings. A
cache that cannot be written never stops a command: it says so in one line and the command goes on without it.

Only trusted code may write to the folder (JAX runs what it loads from it), hence a per-user folder, never a shared
one. docs/compile-cache.md has what it saves.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from collections.abc import Callable, MutableMapping
from pathlib import Path

ENV = "BERTFORGE_COMPILE_CACHE"
OFF = "off"
# JAX caches only programs that took at least this long to compile; its default leaves out the train step of a small
# model on a fast machine, and loading a program is cheaper than compiling it however small (docs/compile-cache.md).
MIN_COMPILE_SECONDS = 0.0
# How JAX words a cache it could not read or write; it warns and compiles.
_JAX_CACHE_ERRORS = ("Error writing persistent compilation cache", "Error reading persistent compilation cache")

_UNSET = object()
_in_use: object = _UNSET  # what the first enable() chose: a folder, or None
_hooked = False


def default_folder(environ: MutableMapping[str, str] = os.environ) -> Path:
    """$XDG_CACHE_HOME/bertforge/jax, else ~/.cache/bertforge/jax."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bertforge" / "jax"


def chosen_folder(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """The folder bertforge would use; None when BERTFORGE_COMPILE_CACHE=off."""
    given = environ.get(ENV, "").strip()
    if given.lower() == OFF:
        return None
    return Path(given).expanduser() if given else default_folder(environ)


def _unwritable(folder: Path) -> str | None:
    """Why `folder` cannot hold the cache (it is made if missing), or None when a file can be written there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _set(name: str, value: str | float | bool, environ: MutableMapping[str, str]) -> None:
    """One JAX setting: in the running JAX when it is imported, else in the environment JAX reads when it is (and
    that processes started from this one inherit)."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.config.update(name, value)
    else:
        environ[name.upper()] = str(value).lower() if isinstance(value, bool) else str(value)


def _jax_folder(environ: MutableMapping[str, str]) -> str | None:
    """The cache folder the user gave JAX itself, if any."""
    jax = sys.modules.get("jax")
    if jax is not None:
        return jax.config.jax_compilation_cache_dir
    return environ.get("JAX_COMPILATION_CACHE_DIR") or None


def enable(say: Callable[[str], None] = _stderr, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Turn the cache on (or off) as the environment asks; returns the folder in use, None when off. Call it before
    the first compilation; later calls return what the first one chose."""
    global _in_use
    if _in_use is _UNSET:
        _in_use = _choose(say, environ)
    return _in_use  # type: ignore[return-value]


def _choose(say: Callable[[str], None], environ: MutableMapping[str, str]) -> str | None:
    if ENV not in environ and _jax_folder(environ):
        return _jax_folder(environ)
    folder = chosen_folder(environ)
    problem = None if folder is None else _unwritable(folder)
    if folder is None or problem is not None:
        if problem is not None:
            say(f"warning: compile cache {folder}: {problem}; compiling without it ({ENV}=off or =FOLDER to choose)")
        _set("jax_enable_compilation_cache", False, environ)
        return None
    _set("jax_compilation_cache_dir", str(folder), environ)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
        _set("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS, environ)
    return str(folder)


def say_cache_errors_once(folder: str, say: Callable[[str], None] = _stderr) -> None:
    """JAX warns at every entry it fails to read or write (a full disk fails them all); say the first in one line
    and drop the rest. The command goes on either way: JAX compiles what it cannot load, and keeps what it cannot
    write in memory. JAX writes entries in place, so a write cut short (a full disk, a kill) leaves an entry that
    every later run fails to read: the line says how to clear it.

    For a process bertforge owns (the CLI): it replaces warnings.showwarning, once."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    shown = warnings.showwarning
    said = False

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        nonlocal said
        text = str(message)
        if not text.startswith(_JAX_CACHE_ERRORS):
            return shown(message, category, filename, lineno, file, line)
        if not said:
            said = True
            say(f"warning: compile cache: {text.splitlines()[0]}; going on without it (delete {folder} to clear it)")
        return None

    warnings.showwarning = show
    # Shown through the hook even where warnings are errors (python -W error): a cache never fails a command.
    for start in _JAX_CACHE_ERRORS:
        warnings.filterwarnings("always", message=start, category=UserWarning)
