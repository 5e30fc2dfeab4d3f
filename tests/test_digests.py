"""A guard over the engine's decisions: a dozen configurations (hash, radix, no cache, slab, best-of-n,
token eviction, tiers, replicas, belady, a closed loop, the Mooncake slice) replayed on the shipped
traces with a frozen linear clock, their requests.parquet and steps.parquet hashed and compared with
the digests pinned in tests/data/digests.json. The clock is fixed so that the digests pin scheduling
and memory, not the cost model (which is fitted elsewhere and may change); a refactor must leave
every digest as it is. A deliberate change of behaviour re-pins them:
KVBENCH_UPDATE_DIGESTS=1 python -m pytest tests/test_digests.py, and says why in its commit."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import replay

REPO = Path(__file__).resolve().parents[1]
PINNED = REPO / "tests" / "data" / "digests.json"
CLOCK = {"kind": "linear", "prefill_ms_per_token": 0.05, "decode_step_ms": 12, "overhead_ms": 1}
BASE = dict(executor="sim", model="llama-3-8b", max_model_len=16384)

# name -> (trace, settings): each a rule the engine must keep
CONFIGS = {
    "chat-hash-lru": ("chat.jsonl", dict(limit=120, num_blocks=1500, time_scale=0.05)),
    "chat-no-cache": ("chat.jsonl", dict(limit=120, num_blocks=1500, time_scale=0.05, prefix_cache=False)),
    "chat-radix-node": ("chat.jsonl", dict(limit=120, num_blocks=1500, time_scale=0.05, prefix_mode="radix")),
    "chat-radix-block-fifo": ("chat.jsonl", dict(limit=120, num_blocks=1500, time_scale=0.05, prefix_mode="radix",
                                                  radix_eviction="block", cache_policy="fifo")),
    "chat-slab": ("chat.jsonl", dict(limit=120, num_blocks=4096, time_scale=0.05, layout="slab", max_model_len=8192)),
    "best-of-n": ("best_of_n.jsonl", dict(num_blocks=2000, time_scale=0.2)),
    "agent-h2o": ("agent.jsonl", dict(limit=60, num_blocks=3000, time_scale=0.2, eviction="h2o", kv_budget=0.3)),
    "agent-infinigen": ("agent.jsonl", dict(limit=60, num_blocks=3000, time_scale=0.2, eviction="infinigen")),
    "chat-cpu-tier-write-back": ("chat.jsonl", dict(limit=120, num_blocks=800, time_scale=0.05, cpu_kv_mem="2GiB",
                                                     offload="write-back", load_policy="always")),
    "chat-replicas-kv-aware": ("chat.jsonl", dict(limit=120, num_blocks=800, time_scale=0.05, replicas=3,
                                                   router="kv-aware")),
    "rag-belady": ("rag.jsonl", dict(limit=150, num_blocks=600, time_scale=0.1, cache_policy="belady")),
    "rag-arc": ("rag.jsonl", dict(limit=150, num_blocks=600, time_scale=0.1, cache_policy="arc")),
    "chat-closed-loop": ("chat.jsonl", dict(limit=120, num_blocks=1500, max_concurrency=8, dependent_turns=True)),
    "mooncake-slice": ("mooncake_slice.jsonl", dict(num_blocks=6000, time_scale=0.5, max_model_len=32768)),
    "chat-length-rule": ("chat.jsonl", dict(limit=120, num_blocks=1500, time_scale=0.05, max_model_len=2048)),
}


def digest(run_dir: Path) -> dict[str, str]:
    """sha256 (16 hex digits) of each table, floats rounded to 9 significant digits, and the summary's
    counts (what scheduling and memory decide)."""
    out = {}
    for name in ("requests", "steps"):
        df = pd.read_parquet(run_dir / f"{name}.parquet")
        for col in df.columns:
            if df[col].dtype.kind == "f":
                df[col] = df[col].map(lambda v: "nan" if v != v else f"{v:.9g}")
        out[name] = hashlib.sha256(df.to_csv(index=False).encode()).hexdigest()[:16]
    summary = json.loads((run_dir / "summary.json").read_text())
    keys = ("completed", "rejected", "preemptions", "recomputed_tokens", "evicted_tokens", "recalled_tokens",
            "peak_running", "cache_evictions", "steps", "output_tokens")
    out["summary"] = ",".join(f"{k}={summary.get(k)}" for k in keys)
    return out


def _run(name: str, tmp_path: Path) -> dict[str, str]:
    trace, settings = CONFIGS[name]
    clock = tmp_path / "clock.json"
    clock.write_text(json.dumps(CLOCK))
    cfg = ReplayConfig(**{**BASE, **settings, "calibration": str(clock)})
    replay(str(REPO / "traces" / trace), cfg, str(tmp_path / name))
    return digest(tmp_path / name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_equal_the_pinned_digests(name, tmp_path):
    got = _run(name, tmp_path)
    pinned = json.loads(PINNED.read_text()) if PINNED.exists() else {}
    if os.environ.get("KVBENCH_UPDATE_DIGESTS"):
        pinned = json.loads(PINNED.read_text()) if PINNED.exists() else {}  # other workers' updates
        pinned[name] = got
        PINNED.write_text(json.dumps(dict(sorted(pinned.items())), indent=1) + "\n")
        return
    assert name in pinned, f"no digest pinned for {name}: run with KVBENCH_UPDATE_DIGESTS=1"
    assert got == pinned[name]


def test_the_digest_sees_a_one_token_change(tmp_path):
    """The digest is not blind: one request's cached tokens changed by one changes it."""
    name = "best-of-n"
    _run(name, tmp_path)
    before = digest(tmp_path / name)
    df = pd.read_parquet(tmp_path / name / "requests.parquet")
    df.loc[0, "cached_tokens"] = int(df.loc[0, "cached_tokens"]) + 1
    df.to_parquet(tmp_path / name / "requests.parquet")
    assert digest(tmp_path / name)["requests"] != before["requests"]
    assert np.isfinite(json.loads((tmp_path / name / "summary.json").read_text())["duration_s"])
