"""numba as kvbench uses it: the compiled cores cache their machine code on disk, so only the first
run on an install compiles (tens of seconds, said on stderr by compile_notice).

numba writes its cache beside the package's sources; where the install is read-only (a system
site-packages, a container image) the cache goes to the user's cache directory instead
($XDG_CACHE_HOME/kvbench/numba), unless NUMBA_CACHE_DIR says where. Every compiled module imports
numba through ``from kvbench.jit import numba`` so that this is settled before numba reads it.
"""
from __future__ import annotations

import importlib
import os

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# the compiled modules each kind of command calls
REPLAY_MODULES = ("kvbench.trace.compiled", "kvbench.trace.compiled_ideal", "kvbench.memory.compiled",
                  "kvbench.scheduler.compiled")
WHATIF_MODULES = ("kvbench.trace.scan", "kvbench.trace.compiled", "kvbench.whatif.compiled")


def user_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvbench", "numba")


def writable(path: str) -> bool:
    return os.access(path, os.W_OK)


def configure_cache(package_dir: str = _PACKAGE_DIR) -> str | None:
    """Point NUMBA_CACHE_DIR at the user's cache when the package directory is read-only and the user
    named no cache; -> the directory set, or None when nothing was changed."""
    if os.environ.get("NUMBA_CACHE_DIR") or writable(package_dir):
        return None
    path = user_cache_dir()
    os.makedirs(path, exist_ok=True)
    os.environ["NUMBA_CACHE_DIR"] = path
    return path


configure_cache()

import numba  # noqa: E402  (after the cache directory is settled)


def _cached(fn) -> bool | None:
    """Whether a compiled function has machine code on disk; None where it is not one numba caches
    apart (inlined helpers are compiled into their callers)."""
    if fn.targetoptions.get("inline") == "always":
        return None
    index = getattr(getattr(getattr(fn, "_cache", None), "_cache_file", None), "_index_path", None)
    return None if index is None else os.path.exists(index)


def cold_modules(modules) -> list[str]:
    """The modules of ``modules`` with compiled functions none of which is cached yet: a command that
    uses them compiles first. (A module counts as warm once any of its functions is cached: the
    first run compiles what it calls, and a later command compiles little more.)"""
    from numba.core.registry import CPUDispatcher

    cold = []
    for name in modules:
        mod = importlib.import_module(name)
        states = [_cached(fn) for fn in vars(mod).values()
                  if isinstance(fn, CPUDispatcher) and getattr(fn, "__module__", name) == name]
        states = [s for s in states if s is not None]
        if states and not any(states):
            cold.append(name)
    return cold


def compile_notice(modules) -> str | None:
    """The line to say before a command whose compiled cores are not cached yet, or None."""
    cold = cold_modules(modules)
    if not cold:
        return None
    where = os.environ.get("NUMBA_CACHE_DIR") or "beside the package"
    return (f"compiling {', '.join(m.rsplit('.', 2)[-2] + '/' + m.rsplit('.', 1)[-1] for m in cold)} with numba, "
            f"once per install (about half a minute on two cores; cached {where})")


__all__ = ["numba", "cold_modules", "compile_notice", "configure_cache", "REPLAY_MODULES", "WHATIF_MODULES"]
