"""What the report reads: runs, sweeps and what-if tables found under the given directories,
grouped into one section per trace.

A directory with sweep.parquet is a sweep (its runs are the rows' run directories); one with
summary.json is a run; one with whatif.parquet is a ``kvbench trace whatif`` table; any other
directory is searched one level down for those. Runs are grouped by the trace's sha256 (its path when
the hash is missing), so runs of different traces are never compared in one chart.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import pandas as pd

from kvbench.engine.config import ReplayConfig
from kvbench.errors import InputError
from kvbench.sweep import SWEEP_PARQUET, not_applicable

WHATIF_PARQUET = "whatif.parquet"
DEFAULTS = ReplayConfig().to_dict()
# The baseline every configuration is compared with (design.md: the slab is the same engine with a
# different allocator). A setting, not code: the report does not know what a layout is.
BASELINE = ("layout", "slab")


@dataclass
class Run:
    dir: str
    label: str
    config: dict
    summary: dict
    _steps: pd.DataFrame | None = None
    _requests: pd.DataFrame | None = None

    @property
    def settings(self) -> dict:
        return self.config.get("settings", {})

    @property
    def unused(self) -> set[str]:
        return not_applicable(self.settings)

    def uses(self, name: str) -> bool:
        """Whether this run uses a setting (slab has no block size)."""
        return name not in self.unused

    def setting(self, name: str):
        """The value of a setting this run uses, else None."""
        return self.settings.get(name) if self.uses(name) else None

    @property
    def trace(self) -> dict:
        return self.config.get("trace", {})

    @property
    def trace_key(self) -> str:
        return self.trace.get("sha256") or self.trace.get("path") or "unknown trace"

    @property
    def is_baseline(self) -> bool:
        return self.settings.get(BASELINE[0]) == BASELINE[1]

    @property
    def steps(self) -> pd.DataFrame:
        if self._steps is None:
            self._steps = pd.read_parquet(os.path.join(self.dir, "steps.parquet"))
        return self._steps

    @property
    def requests(self) -> pd.DataFrame:
        if self._requests is None:
            self._requests = pd.read_parquet(os.path.join(self.dir, "requests.parquet"))
        return self._requests

    def metric(self, key: str) -> float | None:
        v = self.summary.get(key)
        return None if v is None else float(v)


@dataclass
class WhatIf:
    dir: str
    label: str
    table: pd.DataFrame


@dataclass
class Section:
    """The runs of one trace, in the order given."""

    title: str
    slug: str
    runs: list[Run]
    varying: list[str] = field(default_factory=list)  # settings that differ between the runs

    def baseline_for(self, run: Run) -> Run | None:
        """The baseline run whose settings differ least from ``run``'s (None when there is none)."""
        bases = [b for b in self.runs if b.is_baseline]
        if not bases:
            return None

        def distance(b: Run) -> int:
            shared = set(run.settings) - run.unused - b.unused
            return sum(run.settings.get(k) != b.settings.get(k) for k in shared)
        return min(bases, key=distance)


@dataclass
class Inputs:
    sections: list[Section]
    whatifs: list[WhatIf]


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _load_run(run_dir: str, label: str) -> Run:
    try:
        return Run(run_dir, label, _read_json(os.path.join(run_dir, "config.json")),
                   _read_json(os.path.join(run_dir, "summary.json")))
    except (OSError, ValueError) as e:
        raise InputError(f"not a readable run directory: {e}", file=run_dir) from None


def _sweep_runs(sweep_dir: str) -> list[Run]:
    table = pd.read_parquet(os.path.join(sweep_dir, SWEEP_PARQUET), columns=["run"])
    return [_load_run(os.path.join(sweep_dir, name), name) for name in table["run"]
            if os.path.exists(os.path.join(sweep_dir, name, "summary.json"))]


def _kind(d: str) -> str | None:
    for name, kind in ((SWEEP_PARQUET, "sweep"), ("summary.json", "run"), (WHATIF_PARQUET, "whatif")):
        if os.path.isfile(os.path.join(d, name)):
            return kind
    return None


def load_inputs(paths: list[str]) -> Inputs:
    """Everything under ``paths``; InputError (exit 2) for a path that holds none of it."""
    runs: list[Run] = []
    whatifs: list[WhatIf] = []

    def take(d: str, kind: str) -> None:
        if kind == "sweep":
            runs.extend(_sweep_runs(d))
        elif kind == "run":
            runs.append(_load_run(d, os.path.basename(os.path.normpath(d))))
        else:
            whatifs.append(WhatIf(d, os.path.basename(os.path.normpath(d)),
                                  pd.read_parquet(os.path.join(d, WHATIF_PARQUET))))

    for p in paths:
        if not os.path.isdir(p):
            raise InputError("not a directory", file=p)
        kind = _kind(p)
        if kind is not None:
            take(p, kind)
            continue
        found = [(os.path.join(p, n), _kind(os.path.join(p, n))) for n in sorted(os.listdir(p))
                 if os.path.isdir(os.path.join(p, n))]
        found = [(d, k) for d, k in found if k is not None]
        if not found:
            raise InputError("holds no run (summary.json), sweep (sweep.parquet) or what-if table "
                             "(whatif.parquet), nor directories that do", file=p)
        for d, k in found:
            take(d, k)
    sections = _sections(runs)
    for section in sections:
        _unique_labels(section.runs)
    return Inputs(sections, whatifs)


def _unique_labels(runs: list[Run]) -> None:
    """Runs of one trace from different sweeps may share a name (``slab``): prefix the parent
    directory, then number what still clashes."""
    def clashing() -> list[Run]:
        count: dict[str, int] = {}
        for r in runs:
            count[r.label] = count.get(r.label, 0) + 1
        return [r for r in runs if count[r.label] > 1]

    for r in clashing():
        r.label = f"{os.path.basename(os.path.dirname(os.path.abspath(r.dir)))}/{r.label}"
    for i, r in enumerate(clashing()):
        r.label = f"{r.label} #{i + 1}"


def _sections(runs: list[Run]) -> list[Section]:
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.trace_key, []).append(r)
    sections = []
    stems: dict[str, int] = {}
    for key, group in groups.items():
        path = group[0].trace.get("path") or key
        stem = os.path.splitext(os.path.basename(path))[0]
        stems[stem] = stems.get(stem, 0) + 1
        slug = stem if stems[stem] == 1 else f"{stem}-{stems[stem]}"
        title = os.path.basename(path) + (f" (sha256 {key[:12]})" if stems[stem] > 1 else "")
        sections.append(Section(title, _safe(slug), group, varying_settings(group)))
    return sections


def varying_settings(runs: list[Run]) -> list[str]:
    """Settings (in ReplayConfig order) whose used values differ between runs."""
    out = []
    for name in DEFAULTS:
        # a setting some runs do not use (slab's block size) varies only if the others disagree
        values = {json.dumps(r.settings.get(name)) for r in runs if r.uses(name)}
        if len(values) > 1:
            out.append(name)
    return out


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text) or "trace"
