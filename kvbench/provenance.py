"""Where a result came from: the code that made it, the files its settings name, the command line,
the host and the user's tags. config.json and sweep.json record these, and the sweep reuses a run only
when every one of them that decides the output is equal (kvbench.sweep.runner.reuse_verdict).

The code is identified by a fingerprint of kvbench's own source files (the package, its kernels and
workloads), so an installed copy without git is identified as well as a checkout; the git commit is
recorded beside it only when the checkout is kvbench's own.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache

_PACKAGES = ("kvbench", "kvbench.kernels", "kvbench.workloads")


def _package_dirs() -> list[str]:
    import importlib.util

    dirs = []
    for name in _PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(spec.submodule_search_locations)
    return dirs


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 (first 16 hex digits) over kvbench's Python sources, by path relative to their
    package: equal exactly when the code that computes a result is."""
    h = hashlib.sha256()
    for base in _package_dirs():
        files = []
        for root, subdirs, names in os.walk(base):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
            files += [os.path.join(root, n) for n in names if n.endswith(".py")]
        for path in sorted(files):
            rel = os.path.relpath(path, os.path.dirname(base))
            h.update(rel.encode() + b"\0")
            with open(path, "rb") as fh:
                h.update(fh.read())
            h.update(b"\0")
    return h.hexdigest()[:16]


def _git(repo: str, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@lru_cache(maxsize=1)
def git_info() -> dict:
    """{"git_commit", "git_dirty"} of kvbench's own checkout; both None for an installed copy, or for
    a copy that merely lies inside some other repository."""
    return git_info_of(os.path.dirname(os.path.abspath(__file__)))


def git_info_of(here: str) -> dict:
    """git_info for a kvbench package folder ``here``: its checkout counts when the repository's top
    holds that folder as kvbench/ and a pyproject.toml naming the project kvbench."""
    top = _git(here, "rev-parse", "--show-toplevel")
    none = {"git_commit": None, "git_dirty": None}
    if not top or os.path.realpath(os.path.join(top, "kvbench")) != os.path.realpath(here):
        return none
    try:
        with open(os.path.join(top, "pyproject.toml"), encoding="utf-8") as fh:
            if 'name = "kvbench"' not in fh.read():
                return none
    except OSError:
        return none
    commit = _git(top, "rev-parse", "HEAD")
    status = _git(top, "status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def file_sha256(path: str) -> str | None:
    """The file's sha256, or None when it cannot be read."""
    try:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


def setting_files(settings: dict) -> dict[str, str | None]:
    """sha256 of every file a configuration's settings name (a calibration, a learned policy's model,
    a --model folder's or file's config.json), by setting: a changed file changes the run."""
    out: dict[str, str | None] = {}
    if settings.get("calibration"):
        out["calibration"] = file_sha256(settings["calibration"])
    for name in ("cache_policy", "cpu_cache_policy", "disk_cache_policy"):
        value = str(settings.get(name) or "")
        if value.startswith("learned:"):
            out[name] = file_sha256(value.split(":", 1)[1])
    model = settings.get("model")
    if model and os.path.exists(str(model)):
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        out["model"] = file_sha256(path)
    return out


def now_iso() -> str:
    """The current time, UTC, to the second: 2026-12-03T08:20:12Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Invocation:
    """How a run was asked for: the command line and the user's ``--metadata KEY=VALUE`` tags."""

    command_line: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_argv(cls, metadata: dict[str, str] | None = None) -> "Invocation":
        args = [os.path.basename(sys.argv[0]) or "kvbench", *sys.argv[1:]] if sys.argv else []
        if args and args[0] in ("__main__.py", "-c", "-m"):
            args[0] = "kvbench"
        return cls(shlex.join(args) if args else None, dict(metadata or {}))

    def record(self) -> dict:
        """The fields config.json and sweep.json carry for it."""
        return {"command_line": self.command_line, "host": socket.gethostname(), "metadata": self.metadata}


def parse_metadata(pairs) -> dict[str, str]:
    """``--metadata KEY=VALUE`` (repeatable, or comma-free pairs) -> {KEY: VALUE}; ValueError names
    the pair that is not KEY=VALUE."""
    out: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = str(pair).partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        out[key.strip()] = value
    return out
