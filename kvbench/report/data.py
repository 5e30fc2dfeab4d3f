"""What the report reads: runs, sweeps and what-if tables found under the given directories, and
the comparable groups the runs fall into (one report section each).

A directory with sweep.parquet is a sweep (its runs are the rows' run directories); one with
summary.json is a run; one with whatif.parquet is a ``kvbench trace whatif`` table; any other
directory is searched below (a few levels) for those.

Two runs are compared, in one chart or as a ratio, only when everything in COMPARABLE is equal:
the same requests of the same trace, on the same model, executor, GPU, arrival time scale and KV
pool. Every other setting (those ReplayConfig gains later included) may vary inside a group, and a
run's label names the ones that do, in words (kvbench.report.words).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvbench.engine.config import ReplayConfig, parse_size, tier_bytes
from kvbench.engine.records import REQUEST_SCHEMA, STEP_SCHEMA
from kvbench.errors import InputError
from kvbench.report import words
from kvbench.sweep import SWEEP_PARQUET, not_applicable

WHATIF_PARQUET = "whatif.parquet"
DEFAULTS = ReplayConfig().to_dict()
# The baseline every configuration is compared with (design.md: the slab is the same engine with a
# different allocator). A setting, not code: the report does not know what a layout is.
BASELINE = ("layout", "slab")
SEARCH_DEPTH = 3  # how far below a given directory runs and sweeps are looked for


@dataclass
class Run:
    dir: str
    name: str  # the run directory's name, made unique among the runs of one report
    config: dict
    summary: dict
    label: str = ""  # in words, from the settings that vary in its group (set by the grouping)
    color: str = "black"  # one colour and marker per label across every chart (report.charts)
    marker: str = "o"
    _steps: pd.DataFrame | None = None
    _requests: pd.DataFrame | None = None

    def _part(self, name: str) -> dict:
        part = self.config.get(name)
        return part if isinstance(part, dict) else {}

    @property
    def settings(self) -> dict:
        return self._part("settings")

    def value(self, name: str):
        """A setting as the run had it; one the run's kvbench did not have yet reads as today's default."""
        return self.settings.get(name, DEFAULTS.get(name))

    @property
    def unused(self) -> set[str]:
        return not_applicable(self.settings)

    def uses(self, name: str) -> bool:
        """Whether this run uses a setting (slab has no block size)."""
        return name not in self.unused

    def setting(self, name: str):
        """The value of a setting this run uses, else None."""
        return self.value(name) if self.uses(name) else None

    @property
    def trace(self) -> dict:
        return self._part("trace")

    @property
    def environment(self) -> dict:
        return self._part("environment")

    @property
    def trace_key(self) -> str:
        return self.trace.get("sha256") or self.trace.get("path") or "unknown trace"

    @property
    def is_baseline(self) -> bool:
        return self.settings.get(BASELINE[0]) == BASELINE[1]

    @property
    def block_size(self) -> int:
        return _count(self.summary.get("block_size")) or _count(self.value("block_size")) or DEFAULTS["block_size"]

    @property
    def disagg(self) -> dict:
        """A disaggregated run's own figures (summary.json's "disagg": instances, GPUs, link), else {}."""
        part = self.summary.get("disagg")
        return part if isinstance(part, dict) else {}

    @property
    def replicas(self) -> int:
        """Mixed engine instances (each does prefill and decode); a P:D run's instances are in ``disagg``."""
        return _count(self.value("replicas")) or 1

    @property
    def gpus(self) -> int:
        """GPUs the run served on: a P:D run's prefill and decode instances at their own tp (the
        engine's count), else replicas x tp."""
        return _count(self.disagg.get("gpus")) or self.replicas * (_count(self.value("tp")) or 1)

    def per_gpu(self, key: str) -> float | None:
        """A rate over the GPUs the run served on (goodput per GPU), else None."""
        v = self.metric(key)
        return None if v is None else v / self.gpus

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
        try:
            v = float(self.summary.get(key))
        except (TypeError, ValueError):  # None: no data
            return None
        return None if math.isnan(v) else v  # NaN (an older run's "no data") is None too


def _count(v) -> int | None:
    """A whole number above zero, else None (a hand-edited file's string or bool included)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


# -- what makes two runs comparable ------------------------------------------------------------
def _requests(r: Run):
    n = r.trace.get("requests")
    return n if n is not None else r.value("limit")


def _hardware(r: Run):
    """The GPU the sim models, or the device a model executor ran on."""
    return r.value("gpu") if r.uses("gpu") else (r.environment.get("device_name") or r.value("device"))


def _pool(r: Run):
    """The KV pool as the user sized it: bytes (--kv-mem), token slots (--num-blocks, at the run's
    block size), or the executor's default."""
    mem, blocks = r.value("kv_mem"), r.value("num_blocks")
    if mem:
        try:
            return ("bytes", parse_size(mem))
        except InputError:
            return ("kv_mem", str(mem))
    if isinstance(blocks, int) and blocks > 0:
        return ("tokens", blocks * r.block_size)
    return ("default", None)


# (key, how a run gives it): what must be equal for two runs to be compared. A setting not decided
# by these keys (GROUPED below) varies inside a group, so a setting added later is compared, never
# silently merged.
COMPARABLE: list[tuple[str, Callable[[Run], object]]] = [
    ("trace", lambda r: r.trace_key),
    ("requests", _requests),  # --limit, as the number of requests the run replayed
    ("model", lambda r: r.value("model")),
    ("executor", lambda r: r.value("executor")),
    ("hardware", _hardware),  # --gpu (sim) or the device (model)
    ("time_scale", lambda r: r.value("time_scale")),
    ("kv_pool", _pool),  # --kv-mem / --num-blocks
]
# the settings those keys decide: equal inside a group by construction, so never in a label
GROUPED = {"limit", "model", "executor", "gpu", "device", "time_scale", "kv_mem", "num_blocks"}


def comparable_key(r: Run) -> tuple:
    return tuple(json.dumps(read(r), sort_keys=True, default=str) for _, read in COMPARABLE)


@dataclass
class WhatIf:
    dir: str
    label: str
    table: pd.DataFrame


@dataclass
class Section:
    """One comparable group: runs equal on every COMPARABLE key, baselines first."""

    title: str
    slug: str
    runs: list[Run]
    varying: list[str] = field(default_factory=list)  # settings that differ between the runs
    merged: list[tuple[Run, Run]] = field(default_factory=list)  # (left out, the same configuration kept)

    @property
    def ceiling(self) -> float | None:
        """The group's ideal hit rate (infinite cache, no concurrency, over the requests admitted):
        the highest any of its runs could reach."""
        ideals = [r.metric("ideal_hit_rate") for r in self.runs]
        ideals = [x for x in ideals if x is not None]
        return max(ideals) if ideals else None

    @property
    def baselines(self) -> list[Run]:
        return [r for r in self.runs if r.is_baseline]

    def baseline_for(self, run: Run) -> Run | None:
        """The baseline run of this group whose settings differ least from ``run``'s."""
        bases = self.baselines
        if not bases:
            return None

        def distance(b: Run) -> int:
            shared = set(run.settings) - run.unused - b.unused
            return sum(run.value(k) != b.value(k) for k in shared)
        return min(bases, key=distance)


@dataclass
class Inputs:
    sections: list[Section]
    whatifs: list[WhatIf]
    skipped: list[str] = field(default_factory=list)  # one line per input left out, naming its file


ON_BAD = ("skip", "stop")
RUN_PARQUETS = {"steps.parquet": STEP_SCHEMA, "requests.parquet": REQUEST_SCHEMA}


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except OSError as e:
        raise InputError(f"cannot read ({e.strerror or e})", file=path) from None
    except (ValueError, RecursionError) as e:
        raise InputError(f"not JSON ({str(e).splitlines()[0][:80]})", file=path) from None
    if not isinstance(obj, dict):
        raise InputError("must be a JSON object", file=path)
    return obj


def _check_parquet(path: str, schema: pa.Schema | None = None, columns=()) -> None:
    """A readable parquet file with the columns a report needs (the footer is read, not the data)."""
    try:
        have = pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"not a readable parquet file ({str(e).splitlines()[0][:80]})", file=path) from None
    want = list(columns) + ([] if schema is None else schema.names)
    missing = [c for c in want if c not in have.names]
    if missing:
        raise InputError(f"lacks column {missing[0]!r}", file=path)


# summary.json keys that are not numbers (every other key is a number or null)
SUMMARY_TYPES = {"complete": (bool,), "router": (str, type(None)), "per_replica": (list, type(None)),
                 "kv_cache_groups": (str, type(None)), "disagg": (dict, type(None)),
                 "metadata": (dict, type(None))}


def _check_summary(summary: dict, path: str) -> None:
    """Every figure a number or null (NaN accepted: older runs wrote it), the few other keys of their
    type: a summary.json edited by hand or by another tool is refused naming the key."""
    for key, value in summary.items():
        kinds = SUMMARY_TYPES.get(key)
        if kinds is not None:
            ok = isinstance(value, kinds)
        else:
            ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok:
            names = {type(None): "null", bool: "true or false", str: "a string", list: "a list", dict: "an object"}
            want = " or ".join(names[k] for k in kinds) if kinds else "a number or null"
            raise InputError(f"must be {want}, got {json.dumps(value)[:40]}", file=path, field=key)


def _load_run(run_dir: str, name: str) -> Run:
    """A run whose files are all readable and of the right shape, else InputError naming the file."""
    config = _read_json(os.path.join(run_dir, "config.json"))
    summary = _read_json(os.path.join(run_dir, "summary.json"))
    _check_summary(summary, os.path.join(run_dir, "summary.json"))
    if not isinstance(config.get("settings"), dict):
        raise InputError("has no 'settings' object (not a kvbench run's config)", file=os.path.join(run_dir, "config.json"))
    for fname, schema in RUN_PARQUETS.items():
        _check_parquet(os.path.join(run_dir, fname), schema)
    return Run(run_dir, name, config, summary)


def _sweep_runs(sweep_dir: str, take_run) -> None:
    path = os.path.join(sweep_dir, SWEEP_PARQUET)
    _check_parquet(path, columns=["run"])
    for name in pd.read_parquet(path, columns=["run"])["run"]:
        if os.path.exists(os.path.join(sweep_dir, str(name), "summary.json")):
            take_run(os.path.join(sweep_dir, str(name)), str(name))


def _kind(d: str) -> str | None:
    for name, kind in ((SWEEP_PARQUET, "sweep"), ("summary.json", "run"), (WHATIF_PARQUET, "whatif")):
        if os.path.isfile(os.path.join(d, name)):
            return kind
    return None


def _search(d: str, depth: int) -> list[tuple[str, str]]:
    """Runs, sweeps and what-if tables below ``d`` (sorted by name), not looking inside what is found."""
    found = []
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return found
    for n in names:
        sub = os.path.join(d, n)
        if n.startswith(".") or not os.path.isdir(sub):
            continue
        kind = _kind(sub)
        if kind is not None:
            found.append((sub, kind))
        elif depth > 1:
            found += _search(sub, depth - 1)
    return found


def load_inputs(paths: list[str], on_bad: str = "skip") -> Inputs:
    """Everything under ``paths``. A path that holds nothing kvbench wrote is an InputError (exit 2);
    a run, sweep or what-if table that cannot be read (truncated or corrupt parquet, a summary.json
    of the wrong shape) is left out with a line in ``skipped`` (``on_bad="skip"``) or stops the
    report with an InputError naming the file (``"stop"``)."""
    runs: list[Run] = []
    whatifs: list[WhatIf] = []
    skipped: list[str] = []

    def guarded(fn, *args) -> None:
        try:
            fn(*args)
        except InputError as e:
            if on_bad == "stop":
                raise
            skipped.append(str(e))

    def take_run(d: str, name: str) -> None:
        guarded(lambda: runs.append(_load_run(d, name)))

    def take_whatif(d: str) -> None:
        path = os.path.join(d, WHATIF_PARQUET)
        _check_parquet(path, columns=["budget_blocks", "policy", "hit_rate"])
        label = os.path.basename(os.path.normpath(d))
        try:  # a what-if across replicas says so in its label
            meta = json.loads(open(os.path.join(d, "whatif.json"), encoding="utf-8").read())
            if isinstance(meta, dict) and isinstance(meta.get("replicas"), int) and meta["replicas"] > 1:
                label += f" · {meta['replicas']} replicas, router {meta.get('router')}"
        except (OSError, ValueError):
            pass
        whatifs.append(WhatIf(d, label, pd.read_parquet(path)))

    def take(d: str, kind: str) -> None:
        if kind == "sweep":
            guarded(_sweep_runs, d, take_run)
        elif kind == "run":
            take_run(d, os.path.basename(os.path.normpath(d)))
        else:
            guarded(take_whatif, d)

    for p in paths:
        if not os.path.isdir(p):
            raise InputError("not a directory", file=p)
        kind = _kind(p)
        found = [(p, kind)] if kind is not None else _search(p, SEARCH_DEPTH)
        if not found:
            raise InputError("holds no run (summary.json), sweep (sweep.parquet) or what-if table "
                             "(whatif.parquet), nor directories that do", file=p)
        for d, k in found:
            take(d, k)
    if not runs and not whatifs:
        raise InputError("nothing readable to report: " + "; ".join(skipped[:3]), file=paths[0])
    _unique_names(runs)
    return Inputs(group(runs), whatifs, skipped)


def _unique_names(runs: list[Run]) -> None:
    """Runs from different sweeps may share a directory name (``slab``): prefix the parent
    directory, then number what still clashes."""
    def clashing() -> list[Run]:
        count: dict[str, int] = {}
        for r in runs:
            count[r.name] = count.get(r.name, 0) + 1
        return [r for r in runs if count[r.name] > 1]

    for r in clashing():
        r.name = f"{os.path.basename(os.path.dirname(os.path.abspath(r.dir)))}/{r.name}"
    for i, r in enumerate(clashing()):
        r.name = f"{r.name} #{i + 1}"


# -- the groups --------------------------------------------------------------------------------
def group(runs: list[Run]) -> list[Section]:
    """Runs -> one Section per comparable group: groups with a baseline first, each in the order
    the groups first appear."""
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        groups.setdefault(comparable_key(r), []).append(r)
    sections = []
    for members in groups.values():
        kept, merged = _merge_same(members)
        varying = varying_settings(kept)
        kept.sort(key=lambda r: _order(r, varying))
        _label(kept, varying)
        sections.append(Section(group_title(kept), "", kept, varying, merged))
    sections.sort(key=lambda s: not s.baselines)  # comparisons with the baseline first, else as found
    firsts: dict[str, Run] = {}
    taken: set[str] = set()
    for section in sections:
        section.slug = _slug(section.runs[0], firsts, taken)
    return sections


def _settings_key(r: Run) -> str:
    used = {k: r.value(k) for k in set(DEFAULTS) | set(r.settings) if r.uses(k)}
    return json.dumps(used, sort_keys=True, default=str)


def _merge_same(runs: list[Run]) -> tuple[list[Run], list[tuple[Run, Run]]]:
    """Runs of one group with the same settings (a sweep's 'paged-none' and another's
    'paged-bs16-lru') are one configuration: keep the first, list the others. Runs whose settings
    agree but whose figures do not (another kvbench version) are all kept."""
    kept: list[Run] = []
    merged: list[tuple[Run, Run]] = []
    figures = ["output_tok_per_s", "prefix_hit_rate", "internal_frag", "mean_running", "ttft_ms_p50"]
    for r in runs:
        twin = next((k for k in kept if _settings_key(k) == _settings_key(r)
                     and all(k.metric(f) == r.metric(f) for f in figures)), None)
        if twin is None:
            kept.append(r)
        else:
            merged.append((r, twin))
    return kept, merged


def varying_settings(runs: list[Run]) -> list[str]:
    """Settings (ReplayConfig's order, then any this kvbench does not know) whose used values differ
    between runs, leaving out those the comparable keys fix."""
    names = list(DEFAULTS)
    for r in runs:
        names += [k for k in r.settings if k not in names]
    out = []
    for name in names:
        if name in GROUPED:
            continue
        # a setting some runs do not use (slab's block size) varies only if the others disagree
        values = {json.dumps(r.value(name), default=str) for r in runs if r.uses(name)}
        if len(values) > 1:
            out.append(name)
    return out


SIZE_SETTINGS = ("kv_mem", "cpu_kv_mem", "disk_kv_mem")  # sizes written as text: ordered by bytes


def _order(r: Run, varying: list[str]) -> tuple:
    """Baselines first; then by each varying setting in turn, its 'off' side (no prefix cache, no
    eviction) before the rest and numbers in numeric order."""
    key: list = [not r.is_baseline]
    for name in varying:
        v = r.setting(name)
        quiet = words.setting_words(name, v)[1] if v is not None else True
        if name in SIZE_SETTINGS and v is not None:  # "512GiB" after "128GiB"
            try:
                v = tier_bytes(v, name)
            except InputError:
                pass
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        key.append((not quiet, 0 if number else 1, v if number else 0, "" if number else str(v)))
    return tuple(key)


DESCRIBE_ALONE = ["layout", "block_size", "prefix_cache"]  # a run that is alone in its group


def _label(runs: list[Run], varying: list[str]) -> None:
    """Each run's label from the varying settings, in words; quiet words ('no prefix') come back
    where they are needed to tell two runs apart, then numbers."""
    names = varying or DESCRIBE_ALONE
    for r in runs:
        r.label = words.label(r.settings | {k: r.value(k) for k in names}, names, r.unused)
    if len({r.label for r in runs}) < len(runs):
        for r in runs:
            r.label = words.label(r.settings | {k: r.value(k) for k in names}, names, r.unused, loud=True)
    count: dict[str, int] = {}
    for r in runs:
        r.label = words.shorten(r.label or r.name)
        count[r.label] = count.get(r.label, 0) + 1
    seen: dict[str, int] = {}
    for r in runs:
        if count[r.label] > 1:
            seen[r.label] = seen.get(r.label, 0) + 1
            r.label = words.shorten(r.label, words.MAX_LABEL - 3) + f" #{seen[r.label]}"


def _pool_words(r: Run) -> str:
    kind, v = _pool(r)
    tokens = r.metric("kv_capacity_tokens")
    if kind == "bytes":
        return f"{r.value('kv_mem')} KV pool"
    if kind == "tokens":
        return f"KV pool of {v:,} token slots"
    return "default KV pool" + (f" ({tokens:,.0f} token slots)" if tokens else "")


def group_title(runs: list[Run]) -> str:
    """What every run of a group shares, in words: trace, model, executor and hardware, pool, pace."""
    r = runs[0]
    trace = os.path.basename(str(r.trace.get("path") or r.trace_key))
    model = os.path.basename(os.path.normpath(str(r.value("model"))))
    if r.value("executor") == "sim":
        engine = f"{model}, sim cost model of {str(_hardware(r)).upper()}"
    else:
        engine = f"{model}, {r.value('executor')} executor on {_hardware(r)}"
    n = _requests(r)
    parts = [trace, engine, _pool_words(r), f"{n} request{'s' * (n != 1)}" if n is not None else "all requests"]
    ts = r.value("time_scale")
    if ts not in (None, 1, 1.0):
        parts.append(f"arrival times x{ts:g}" if isinstance(ts, (int, float)) else f"time scale {ts}")
    return " · ".join(parts)


# (how a slug names a key, the key's reader) for a second group of the same trace
SLUG_PARTS = [("", lambda r: r.value("executor")), ("", lambda r: os.path.basename(os.path.normpath(str(r.value("model"))))),
              ("", _hardware), ("", lambda r: f"{_requests(r)}req"), ("pool-", lambda r: _pool(r)[1] or "default"),
              ("ts", lambda r: r.value("time_scale"))]


def _slug(r: Run, firsts: dict[str, Run], taken: set[str]) -> str:
    """The trace's file stem for the first group of a trace; a later one adds what sets it apart from
    that first group (``chat-model-tiny-cpu-8req``); numbered if that still clashes."""
    stem = _safe(os.path.splitext(os.path.basename(str(r.trace.get("path") or "trace")))[0])
    first = firsts.setdefault(stem, r)
    parts = [] if first is r else [f"{pre}{read(r)}" for pre, read in SLUG_PARTS if str(read(r)) != str(read(first))]
    slug = base = _safe("-".join([stem, *parts]))
    i = 2
    while slug in taken:
        slug, i = f"{base}-{i}", i + 1
    taken.add(slug)
    return slug


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text) or "trace"
