"""The grid of a sweep: comma lists of replay options -> the distinct configurations, each with a
run directory name that is a pure function of the configuration and the grid.

Settings that a configuration does not use collapse (NOT_APPLICABLE: slab has no block size or prefix
cache, eviction ``none`` has no KV budget, ...), so a grid holds one run per *distinct*
configuration. A run directory is named from the layout and the grid's varying settings
(``paged-bs16-pc_on``), so re-running the same command finds its runs again.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass
from typing import Iterable

import click

from kvbench.engine.config import ReplayConfig, has_tiers
from kvbench.errors import InputError, RunError

DEFAULTS = ReplayConfig()

# (setting, value) -> settings that a configuration with that value does not use. Collapsing them
# to their defaults is what makes "--layout paged,slab --block-size 8,16" one slab run, not two.
NOT_APPLICABLE: dict[tuple[str, object], tuple[str, ...]] = {
    ("layout", "slab"): ("block_size", "prefix_cache", "prefix_mode", "radix_eviction", "cache_policy", "admission",
                         "cpu_kv_mem", "disk_kv_mem", "eviction", "kv_budget", "sink_tokens", "admission_window",
                         "admission_threshold"),  # a slab cannot compact
    ("layout", "paged"): ("slab_reserve",),
    ("prefix_cache", False): ("prefix_mode", "radix_eviction", "cache_policy", "cpu_kv_mem", "disk_kv_mem",
                              "admission_window", "admission_threshold"),
    ("prefix_mode", "hash"): ("radix_eviction",),  # only used with prefix_mode radix
    ("radix_eviction", "node"): ("cache_policy",),  # nodes go by recency (SGLang's lru)
    ("eviction", "none"): ("kv_budget", "sink_tokens"),
    ("admission_window", 0): ("admission_threshold",),
    ("executor", "sim"): ("device", "attention"),
    ("executor", "model"): ("gpu", "calibration", "tp", "dtype", "eager"),
    ("replicas", 1): ("router", "router_prefix_blocks", "router_cache_weight", "router_load_weight",
                      "router_event_delay"),
    ("router", "round-robin"): ("router_prefix_blocks", "router_cache_weight", "router_load_weight", "router_event_delay"),
    ("router", "least-loaded"): ("router_prefix_blocks", "router_cache_weight", "router_load_weight", "router_event_delay"),
    ("router", "session"): ("router_prefix_blocks", "router_cache_weight", "router_load_weight", "router_event_delay"),
    ("router", "prefix"): ("router_cache_weight", "router_load_weight", "router_event_delay"),
    ("router", "kv-aware"): ("router_prefix_blocks",),
    ("router", "conductor"): ("router_prefix_blocks", "router_cache_weight", "router_load_weight"),
    ("cpu_kv_mem", None): ("cpu_bw", "cpu_cache_policy"),
    ("disk_kv_mem", None): ("disk_bw", "disk_cache_policy"),
    ("store_kv_mem", None): ("store_bw", "store_cache_policy", "store_delay", "store_decode"),
    ("disagg", None): ("store_decode", "link", "link_gbps", "link_latency_us", "disagg_local_prefill", "decode_gpu", "decode_tp", "decode_kv_mem",
                       "decode_num_blocks", "decode_max_num_seqs", "decode_max_batched_tokens"),  # no decode pool
}
# used only with a tier behind the pool (not_applicable: with none, all of them)
TIER_SETTINGS = ("offload", "load_policy", "cpu_bw", "disk_bw", "cpu_cache_policy", "disk_cache_policy")  # (the store's: above)

# How a setting reads in a run directory's name; the default is "<short><value>".
SHORT = {"layout": "", "block_size": "bs", "slab_reserve": "res_", "prefix_cache": "pc_", "prefix_mode": "", "radix_eviction": "ev_",
         "cache_policy": "", "eviction": "", "kv_budget": "kvb", "sink_tokens": "sink",
         "executor": "", "model": "m_", "device": "dev_", "gpu": "gpu_", "tp": "tp", "kv_dtype": "kv_", "calibration": "cal_",
         "kv_mem": "mem", "num_blocks": "nb", "max_num_seqs": "seqs", "max_batched_tokens": "mbt",
         "max_model_len": "mml", "admission": "adm_", "watermark": "wm",
         "admission_window": "aw", "admission_threshold": "at", "time_scale": "ts",
         "max_concurrency": "conc", "overlong": "long_", "dependent_turns": "dep_", "slo": "slo_", "limit": "lim", "max_requests": "maxr", "max_seconds": "maxs", "seed": "seed",
         "replicas": "x", "router": "", "router_prefix_blocks": "rpb", "router_cache_weight": "rcw",
         "router_load_weight": "rlw", "router_event_delay": "red", "cpu_kv_mem": "cpu", "disk_kv_mem": "disk",
         "offload": "", "load_policy": "load_", "cpu_bw": "cpubw", "disk_bw": "diskbw", "cpu_cache_policy": "cpu_",
         "dtype": "w_", "eager": "eager_", "disable_hybrid_kv_cache_manager": "nohybrid_",
         "disk_cache_policy": "disk_", "store_kv_mem": "store", "store_bw": "storebw", "store_cache_policy": "store_",
         "store_delay": "stored", "store_decode": "storedec_"}
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def not_applicable(settings: dict) -> set[str]:
    """Settings that a configuration (a ReplayConfig dict) does not use."""
    hit = [(name, unused) for (name, value), unused in NOT_APPLICABLE.items() if settings.get(name) == value
           and not (name == "replicas" and settings.get("disagg") not in (None, "none"))]  # (P:D routes its prefills)
    unused_first = {n for _, unused in hit for n in unused}
    out: set[str] = set()
    for name, unused in hit:  # a setting the configuration does not use rules nothing out
        if name not in unused_first:
            out.update(unused)
    if "cpu_kv_mem" in out or "disk_kv_mem" in out or not has_tiers(settings):
        out.update(TIER_SETTINGS)
    elif not has_tiers(settings, ("cpu", "disk")):  # a shared store alone: always written through
        out.add("offload")
    return out


# -- the grid ----------------------------------------------------------------------------------
def _flag(text: str) -> bool:
    low = text.strip().lower()
    if low in ("on", "true", "yes", "1"):
        return True
    if low in ("off", "false", "no", "0"):
        return False
    raise ValueError("expected on or off")


def _slos(parts: list[str]) -> list[str]:
    """An --slo list: one SLO is several ``name=value`` targets joined by commas, so a new SLO starts
    where a target repeats a name the one before it has ("ttft=500,tpot=50,ttft=1000,tpot=100": two);
    a value without ``=`` (none) stands alone."""
    out: list[str] = []
    names: set[str] = set()
    for part in parts:
        name = part.split("=", 1)[0].strip()
        if out and "=" in part and "=" in out[-1] and name not in names:
            out[-1] += "," + part
        else:
            out.append(part)
            names = set()
        names.add(name)
    return out


def parse_grid(raw: dict[str, str | None], options) -> dict[str, list]:
    """Comma lists from the command line -> typed value lists, for the options that were given.

    ``options`` is kvbench.cli.replay.REPLAY_OPTIONS: the same click types as ``kvbench replay``, so a value
    that replay refuses, the sweep refuses too (InputError naming the flag: one line, exit 2).
    """
    grid: dict[str, list] = {}
    for o in options:
        text = raw.get(o.name)
        if text is None:
            continue
        values = []
        parts = str(text).split(",")
        for part in (_slos(parts) if o.name == "slo" else parts):
            part = part.strip()
            try:
                if not part:
                    raise ValueError("empty value in the list")
                v = _flag(part) if o.kind == "flag" else (
                    part if o.kind is str else o.kind.convert(part, None, None))
            except (ValueError, click.BadParameter) as e:
                msg = e.message if isinstance(e, click.BadParameter) else str(e)
                raise InputError(f"bad value {part!r} in {text!r}: {msg}", field=o.flag) from None
            if v not in values:
                values.append(v)
        grid[o.name] = values
    return grid


def collapse(settings: dict) -> dict:
    """The configuration with every setting it does not use put back to its default, and the rest
    as the replay will read them (ReplayConfig.validate: a slab has no prefix cache)."""
    out = dict(settings)
    for name in not_applicable(settings):
        out[name] = getattr(DEFAULTS, name)
    return ReplayConfig(**out).validate().to_dict()


def add_comparisons(grid: dict[str, list]) -> tuple[dict[str, list], list[str]]:
    """A grid that compares paged with slab needs paged without a prefix cache (the slab has none),
    or the layout's effect cannot be told from the prefix cache's: add it. -> (grid, notes)."""
    layouts = grid.get("layout", [DEFAULTS.layout])
    caches = grid.get("prefix_cache", [DEFAULTS.prefix_cache])
    if "slab" in layouts and "paged" in layouts and False not in caches:
        return ({**grid, "prefix_cache": [*caches, False]},
                ["added --prefix-cache off: slab has no prefix cache, so paged is compared with it at "
                 "equal setting (pc_off rows: the layout's effect; pc_on rows: layout and prefix cache)"])
    return grid, []


def compares(settings: dict, grid: dict[str, list]) -> str:
    """What a row measures against the slab baseline of its grid: '' without one."""
    if "slab" not in grid.get("layout", ()) or settings["layout"] == "slab":
        return "baseline" if settings["layout"] == "slab" else ""
    return "layout + prefix cache" if settings["prefix_cache"] else "layout"


@dataclass
class Config:
    name: str  # run directory name inside the sweep
    cfg: ReplayConfig

    @property
    def settings(self) -> dict:
        return self.cfg.to_dict()


def setting_token(name: str, value) -> str:
    if value is None:
        text = "default"
    elif isinstance(value, bool):
        text = "on" if value else "off"
    elif isinstance(value, float):
        text = f"{value:g}"
    else:
        text = str(value)
    if name in ("model", "calibration") and os.sep in text:
        text = os.path.basename(os.path.normpath(text))
    safe = _UNSAFE.sub("_", text)
    if safe != text:  # a lossy rename must not make two values share a directory
        safe += "_" + hashlib.sha256(str(value).encode()).hexdigest()[:6]
    return SHORT.get(name, name + "_") + safe


def run_name(settings: dict, varying: Iterable[str]) -> str:
    """``paged-bs16-pc_on``: the layout, then each varying setting this configuration uses."""
    skip = not_applicable(settings)
    parts = [setting_token("layout", settings["layout"])]
    parts += [setting_token(n, settings[n]) for n in varying if n != "layout" and n not in skip]
    return "-".join(parts)


def expand(grid: dict[str, list]) -> list[Config]:
    """Every distinct configuration of the grid, in grid order (first option varies slowest)."""
    names = list(grid)
    seen: dict[tuple, Config] = {}
    varying = [n for n in names if len(grid[n]) > 1]
    for combo in itertools.product(*(grid[n] for n in names)):
        settings = collapse({**DEFAULTS.to_dict(), **dict(zip(names, combo))})
        key = tuple(sorted(settings.items(), key=lambda kv: kv[0]))
        if key in seen:
            continue
        cfg = ReplayConfig(**settings).validate()
        seen[key] = Config(run_name(settings, varying), cfg)
    configs = list(seen.values())
    dupes = {c.name for c in configs if sum(d.name == c.name for d in configs) > 1}
    if dupes:  # cannot happen while every varying setting is in the name; guard the invariant
        raise RunError(f"two configurations share the run name {sorted(dupes)[0]!r}")
    return configs


def default_sweep_dir(trace: str, grid: dict[str, list]) -> str:
    """runs/<trace>-sweep-<hash of the trace's content and the grid>: the same command on the same
    trace always finds the same directory, another trace (or the same path rewritten) another one;
    it lies beside replay's runs/<trace>-<timestamp>, where ``kvbench report`` looks by default."""
    from kvbench.provenance import file_sha256

    stem = os.path.splitext(os.path.basename(trace))[0]
    key = json.dumps({"trace_sha256": file_sha256(trace), "grid": grid}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return os.path.join("runs", f"{stem}-sweep-{digest}")
