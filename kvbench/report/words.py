"""Settings in words: a run's name from the settings that vary in its group (``slab``,
``paged bs16 +prefix``, ``h2o``), never a raw key such as ``pc_on`` or ``memdefault``; and, for a table
whose rows all came out equal, the reason why.

A setting this module does not know (one added to ReplayConfig later) still reads as
``<name> <value>``, so a new setting never breaks a label.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from kvbench.engine.config import tier_bytes

MAX_LABEL = 40  # characters: a legend entry or a table row's name


def _budget(v) -> str:
    return f"budget {float(v):.0%}" if float(v) < 1 else f"budget {int(v)} tok"


def _path(v) -> str:
    return os.path.basename(os.path.normpath(str(v)))


# setting -> value -> (words, quiet). A quiet word (the "off" side: no prefix cache, no eviction) is
# left out of a label when the label's other words already tell the runs apart.
WORDS: dict[str, Callable[[object], tuple[str, bool]]] = {
    "layout": lambda v: (str(v), False),
    "block_size": lambda v: (f"bs{v}", False),
    "slab_reserve": lambda v: ("exact-size slab" if v == "exact" else "max-length slab", v == "max"),
    "prefix_cache": lambda v: ("+prefix" if v else "no prefix", not v),
    "prefix_mode": lambda v: (str(v), v == "hash"),
    "radix_eviction": lambda v: (f"{v} eviction", v == "node"),
    "cache_policy": lambda v: (str(v), False),
    "eviction": lambda v: ("no eviction" if v == "none" else str(v), v == "none"),
    "kv_budget": lambda v: (_budget(v), False),
    "sink_tokens": lambda v: (f"{v} sinks", False),
    "executor": lambda v: (f"{v} executor", False),
    "model": lambda v: (_path(v), False),
    "device": lambda v: (str(v), v == "auto"),
    "gpu": lambda v: (str(v).upper(), False),
    "tp": lambda v: (f"tp{v}", v == 1),
    "kv_dtype": lambda v: (f"kv {v}", v == "auto"),
    "dtype": lambda v: (f"weights {v}", v == "auto"), "eager": lambda v: ("eager" if v else "CUDA graphs", not v),
    "disable_hybrid_kv_cache_manager": lambda v: ("KV as full attention" if v else "hybrid KV groups"
                                                  if v is False else "vLLM's KV groups", v is None),
    "calibration": lambda v: (f"cal {_path(v)}" if v else "preset costs", not v),
    "kv_mem": lambda v: (f"{v} KV" if v else "default KV", not v),
    "num_blocks": lambda v: (f"{v} blocks" if v else "default blocks", not v),
    "max_num_seqs": lambda v: (f"max {v} seqs", False),
    "max_batched_tokens": lambda v: (f"{v} tok/step", False),
    "max_model_len": lambda v: (f"max len {v}" if v else "model's max len", not v),
    "overlong": lambda v: ({"vllm": "vLLM's length rule", "sglang": "SGLang's length rule"}.get(v, "overlong refused"),
                           v == "vllm"),
    "admission": lambda v: (f"admit {v}", v == "full-prompt"),
    "watermark": lambda v: (f"watermark {v:g}", not v),
    "admission_window": lambda v: (f"cache-aware admission x{v}" if v else "arrival-order admission", not v),
    "admission_threshold": lambda v: (f"reorder from {v:.0%} full", v == 0.5),
    "time_scale": lambda v: (f"time x{v:g}", v == 1),
    "max_concurrency": lambda v: (f"concurrency {v}" if v else "open loop", not v),
    "slo": lambda v: (f"SLO {v}" if v else "no SLO", not v),
    "dependent_turns": lambda v: ("dependent turns" if v else "independent turns", not v),
    "limit": lambda v: (f"{v} requests" if v else "all requests", not v),
    "max_requests": lambda v: (f"issue {v} requests" if v else "no request limit", not v),
    "max_seconds": lambda v: (f"issue for {v:g} s" if v else "no time limit", not v),
    "seed": lambda v: (f"seed {v}", False),
    "attention": lambda v: (f"{v} attention", v == "auto"),
    "cpu_kv_mem": lambda v: (f"CPU tier {v}" if _size(v) else "no CPU tier", not _size(v)),
    "disk_kv_mem": lambda v: (f"disk tier {v}" if _size(v) else "no disk tier", not _size(v)),
    "store_kv_mem": lambda v: (f"shared store {v}" if _size(v) else "no shared store", not _size(v)),
    "offload": lambda v: (str(v), v == "write-through"),
    "load_policy": lambda v: (f"load {v}", v == "auto"),
    "cpu_bw": lambda v: (f"CPU {v:g} GB/s", False),
    "disk_bw": lambda v: (f"disk {v:g} GB/s", False),
    "cpu_cache_policy": lambda v: (f"CPU tier {v}", v == "lru"),
    "disk_cache_policy": lambda v: (f"disk tier {v}", v == "lru"),
    "replicas": lambda v: (f"{v} replica{'s' * (v != 1)}", v == 1),
    "disagg": lambda v: (f"P:D {v}" if v else "mixed instances", not v),
    "link": lambda v: (f"link {v}", v == "ib-400"),
    "link_gbps": lambda v: (f"link {v:g} Gb/s" if v else "link line rate", not v),
    "link_latency_us": lambda v: (f"link latency {v:g} us" if v else "link's latency", not v),
    "disagg_local_prefill": lambda v: (f"local prefill <= {v}" if v else "all prefills remote", not v),
    "decode_gpu": lambda v: (f"decode {str(v).upper()}" if v else "decode GPU same", not v),
    "decode_tp": lambda v: (f"decode tp{v}" if v else "decode tp same", not v),
    "decode_kv_mem": lambda v: (f"decode {v} KV" if v else "decode KV same", not v),
    "decode_num_blocks": lambda v: (f"decode {v} blocks" if v else "decode blocks same", not v),
    "decode_max_num_seqs": lambda v: (f"decode max {v} seqs" if v else "decode seqs same", not v),
    "decode_max_batched_tokens": lambda v: (f"decode {v} tok/step" if v else "decode tok/step same", not v),
}


def _size(v) -> int:
    """A tier size setting in bytes (0: no tier)."""
    return tier_bytes(v, "size")


def setting_words(name: str, value) -> tuple[str, bool]:
    """(words, quiet) for one setting's value; an unknown setting reads ``<name> <value>``."""
    fn = WORDS.get(name)
    if fn is not None:
        try:
            return fn(value)
        except (TypeError, ValueError):
            pass
    if isinstance(value, bool):
        value = "on" if value else "off"
    return f"{name.replace('_', ' ')} {value}", False


def layout(disagg, replicas: int) -> str:
    """How a run's GPUs serve, in words: ``P:D 3:1`` (prefill and decode instances apart) or
    ``4 mixed replicas`` (each instance does both)."""
    if disagg:
        return setting_words("disagg", disagg)[0]
    return f"{replicas} mixed replica{'s' * (replicas != 1)}"


def shorten(text: str, most: int = MAX_LABEL) -> str:
    return text if len(text) <= most else text[: most - 1].rstrip() + "…"


def label(settings: dict, names: list[str], unused: set[str], loud: bool = False) -> str:
    """The words for ``settings`` restricted to ``names`` (those the run uses); quiet words only when
    ``loud`` or when nothing else is left to say."""
    parts = [setting_words(n, settings.get(n)) for n in names if n not in unused]
    words = [w for w, quiet in parts if loud or not quiet] or [w for w, _ in parts]
    return " ".join(words)


# -- why a table says nothing ------------------------------------------------------------------
def why_identical(varying: list[str], summaries: list[dict]) -> str:
    """One sentence for a table whose rows came out identical: which settings varied and why they
    could not matter on this trace, read from the runs' own counters."""
    def never(key: str) -> bool:
        return all(not s.get(key) for s in summaries)

    names = ", ".join(n.replace("_", " ") for n in varying) or "nothing"
    reasons = []
    if "cache_policy" in varying and never("cache_evictions"):
        reasons.append("no cached block was ever reclaimed (cache_evictions = 0), so the cache policy "
                       "never had a choice to make: give the pool less memory (--kv-mem, --num-blocks)")
    if {"eviction", "kv_budget", "sink_tokens"} & set(varying) and never("evicted_tokens"):
        reasons.append("no token was evicted (evicted_tokens = 0): no sequence outgrew its KV budget")
    if {"kv_mem", "num_blocks", "max_num_seqs", "max_batched_tokens", "watermark"} & set(varying) \
            and never("preemptions"):
        peak = max((s.get("kv_util") or 0) for s in summaries)
        reasons.append(f"memory and the scheduler's limits never bound (no preemption; time-weighted KV "
                       f"use at most {peak:.0%}): replay faster (--time-scale below 1) or give less memory")
    if not reasons:
        reasons.append("what varied did not change any figure on this trace")
    return f"Every row is the same although {names} varied: " + "; ".join(reasons) + "."


# what a user compares configurations by: if these are equal, no configuration is better
PERFORMANCE = ("output_tok_per_s", "ttft_ms_p50", "tpot_ms_p50", "e2e_ms_p50", "mean_running")
SIM_NOISE = 1e-6  # the sim is deterministic: equal is equal
MEASURED_NOISE = 0.03  # measured step times (the model executor) move by a few percent run to run


def performs_alike(summaries: list[dict], measured: bool) -> str | None:
    """Why configurations whose throughput, latency and concurrency are equal within noise cannot be
    told apart, in one sentence; None when they differ (or there is only one)."""
    if not rows_identical(summaries, list(PERFORMANCE), MEASURED_NOISE if measured else SIM_NOISE):
        return None
    util = max((s.get("kv_util") or 0) for s in summaries)
    noise = "within the few percent measured step times vary" if measured else "exactly"
    if not any(s.get("preemptions") for s in summaries) and util < 0.5:
        why = (f"the KV pool never filled (time-weighted KV use at most {util:.1%}, no preemption), so no "
               "layout, block size or cache setting could change how many sequences ran: give the pool less "
               "memory (--kv-mem, --num-blocks) or replay faster (--time-scale below 1)")
    else:
        why = "what varied did not change when or how much work the engine could do on this trace"
    return f"No configuration is faster: throughput, latency and concurrency agree {noise} because {why}."


def rows_identical(summaries: list[dict], keys: list[str], rel: float = 1e-9) -> bool:
    """Whether every summary has the same value (within ``rel``) for every key; a single row is not
    'identical' (there is nothing to compare)."""
    if len(summaries) < 2:
        return False
    for k in keys:
        vals = [s.get(k) for s in summaries]
        if any(v is None for v in vals):
            if any(v is not None for v in vals):
                return False
            continue
        lo, hi = min(vals), max(vals)
        if hi - lo > rel * max(abs(hi), abs(lo), 1e-12):
            return False
    return True


# -- what each headline figure means (the report's glossary; docs/metrics.md has every figure) --
METRIC_DEFINITIONS = [
    ("output tok/s", "output tokens generated / the whole replay's engine time (idle gaps included)"),
    ("mean / peak running seqs", "sequences an engine step worked on (those finishing in it included): "
     "the time-weighted mean over busy steps, and the largest"),
    ("TTFT", "time to first token: first token - arrival, per request; p50/p99 over requests"),
    ("TPOT", "time per output token: (finish - first token) / (output tokens - 1)"),
    ("E2E", "finish - arrival"),
    ("prefix hit rate", "prompt tokens served from the prefix cache / prompt tokens looked up; the "
     "ceiling is the hit rate of an infinite cache with no concurrency"),
    ("internal frag.", "share of the KV slots held by running sequences that hold no token, weighted "
     "by step time (a slab holds its whole reservation)"),
    ("KV util", "tokens held / pool capacity in tokens, weighted by step time; cached-but-unused "
     "blocks count as neither"),
    ("preemptions", "running requests sent back to wait, their KV freed, recomputed later"),
    ("× slab", "the figure over the slab baseline's in the same group (0.50× slab: half the slab's; "
     "3.00× slab: three times it): green where better, red where worse, uncoloured within 5%"),
]
