"""kvbench's engine against vLLM 0.34's own scheduler (benchmarks/vllm_reference: vLLM's Scheduler and
KVCacheManager driven without a model on the same trace and the same linear clock).

One golden file per configuration, tests/data/vllm-0.34-<name>.json.gz, made by
benchmarks/vllm_reference/make_golden.py: for each, every step schedules the same requests with the
same token counts and preempts the same requests, and every request hits the same prefix tokens.

- mooncake2000: the first 2,000 requests of the real Mooncake conversation trace, 48,000 vLLM blocks
  of 16 tokens, 256 sequences, 8,192 batched tokens;
- mooncake6000-7999: the held-out slice, requests 6,000..7,999 of the converted trace, arrival times
  rebased so the first is 0 (golden_trace below, used by make_golden.py too);
- mooncake2000-8kblocks: a pool of 8,000 blocks, which evicts and preempts a lot;
- mooncake2000-block64: 64-token blocks (vLLM 0.34's default block size), 12,000 blocks;
- mooncake1000-seqs32: at most 32 sequences and 2,048 batched tokens, first 1,000 requests;
- rag-2kblocks-cacheaware: the shipped RAG trace (traces/rag.jsonl) at 20x its rate on 2,000 blocks,
  with 0.34's cache-aware admission on (a window of 16, from half the pool held): a queue forms, and
  waiting requests whose document is cached go first (tests/test_scheduler.py has the rule in small);
- dupkey: five requests (tests/data/vllm-0.34-dupkey-trace.jsonl, literal tokens) on 64 blocks, where
  vLLM's duplicate-key rule decides which blocks survive: the last request hits 16 tokens;
- hybrid-<model>-<trace>: vLLM's hybrid KV cache manager with the KV cache groups its own
  get_kv_cache_groups built for gpt-oss-120b (sliding 128 + full), Gemma 3 27B (six sliding-1024
  groups + full), Llama 4 Scout (three chunked-8192 groups + full) and DeepSeek-V3 (one MLA group),
  on the Mooncake slice and on traces/chat.jsonl at 50x its rate, pools under pressure
  (benchmarks/vllm_reference/README.md); kvbench replays each with --model <model>.

The Mooncake-based ones need the real trace beside the checkout (../shared/traces/real) and are
skipped without it. vLLM keeps block 0 as its null block: kvbench's num_blocks is vLLM's - 1.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
from pathlib import Path

import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.trace.format import load_trace, write_trace
from kvbench.trace.importers import convert

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
MOONCAKE = ROOT.parent / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"
GOLDEN_GLOB = "vllm-0.34-*.json.gz"
# The case that comes near ~20 s on the 2-core machine when it is busy (99,467 steps; the others take
# 1-12 s, see benchmarks/vllm_reference/README.md): run it with -m slow, or all with -m 'slow or not slow'.
SLOW = {"mooncake2000-8kblocks", "mooncake2000-block64", "mooncake1000-seqs32",  # the suite keeps the main and the held-out one
        "hybrid-gpt-oss-120b-mooncake2000", "hybrid-gemma-3-27b-mooncake2000",  # 25-90 s each: the suite keeps
        "hybrid-llama-4-scout-mooncake2000"}  # each model's chat golden and DeepSeek-V3's Mooncake one


def step_digest(sched: list, preempted: list) -> str:
    """A short digest of one step: scheduled (request id, tokens) in order, then preempted ids in order."""
    text = json.dumps([[[str(r), int(n)] for r, n in sched], [str(r) for r in preempted]], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def golden_trace(spec: dict, out: Path | str, mooncake: Path | str = MOONCAKE) -> Path:
    """The kvbench trace a golden was made on, from its ``trace_spec``; make_golden.py calls this too,
    so the test replays exactly what vLLM was driven on.

    ``{"file": NAME}``: a trace shipped in tests/data. ``{"shipped": NAME, "time_scale": X}``: a trace
    of traces/ with every t multiplied by X, round(t * X, 6). ``{"mooncake": ..., "start": S, "count": N}``:
    the Mooncake trace converted by kvbench, requests S..S+N-1 of the converted file (its first S+N,
    then the first S dropped); with S > 0 every t is rebased by the slice's earliest t,
    round(t - t0, 6), so the slice starts at 0. Ids stay the trace's line numbers."""
    if "file" in spec:
        return DATA / spec["file"]
    out = Path(out)
    if "shipped" in spec:
        scale = float(spec["time_scale"])
        write_trace([dataclasses.replace(r, t=round(r.t * scale, 6)) for r in load_trace(ROOT / "traces" / spec["shipped"])],
                    out)
        return out
    start, count = int(spec["start"]), int(spec["count"])
    convert("mooncake", str(mooncake), str(out), limit=start + count)
    if start:
        reqs = load_trace(out)[start:]
        t0 = min(r.t for r in reqs)
        write_trace([dataclasses.replace(r, t=round(r.t - t0, 6)) for r in reqs], out)
    return out


def load_golden(path: Path) -> dict:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def golden_files() -> list:
    params = []
    for path in sorted(DATA.glob(GOLDEN_GLOB)):
        name = path.name[len("vllm-0.34-"):-len(".json.gz")]
        marks = [pytest.mark.slow] if name in SLOW else []
        params.append(pytest.param(path, id=name, marks=marks))
    return params


def replay_like_vllm(golden: dict, tmp_path: Path):
    """kvbench's replay of the golden's trace with the golden's settings: (replay, summary)."""
    spec = golden["trace_spec"]
    if "mooncake" in spec and not MOONCAKE.exists():
        pytest.skip("the real Mooncake trace is not beside the checkout")
    trace = golden_trace(spec, tmp_path / "trace.jsonl")
    clock = tmp_path / "linear.json"
    clock.write_text(json.dumps(golden["clock"]))
    model = (golden.get("hybrid") or {}).get("model", "llama-3-8b")  # a hybrid golden names its model's groups
    # the weights of DeepSeek-V3 and Llama 4 Scout fit eight H200s; the pool is given in blocks, so the
    # group of GPUs changes no decision
    tp = 8 if model in ("deepseek-v3", "llama-4-scout") else 1
    # Qwen3-Next's state is one GPU's (tp 1): a B200 holds its weights and runs the Triton GDN prefill; the
    # -h100 golden is FlashInfer's GDN prefill, which exports its checkpoint itself: a Hopper GPU (an H200,
    # fp8 weights to hold them on one)
    gpu, dtype = {"qwen3-next-80b-a3b": ("b200", "auto"), "qwen3-next-80b-a3b-h100": ("h200", "fp8")}.get(
        model, ("h200", "auto"))
    model = model.removesuffix("-h100")
    # the goldens run vLLM's hybrid manager on for every model (Llama 4 too, which vLLM turns it off for
    # unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1, as the driver sets)
    cfg = ReplayConfig(executor="sim", model=model, calibration=str(clock), tp=tp, gpu=gpu, dtype=dtype,
                       disable_hybrid_kv_cache_manager=False if "hybrid" in golden else None,
                       num_blocks=golden["kvbench_num_blocks"], block_size=golden["block_size"],
                       max_num_seqs=golden["max_num_seqs"], max_batched_tokens=golden["max_batched_tokens"],
                       prefix_cache=golden.get("prefix_caching", True),  # (off: vLLM's Mamba "none" mode)
                       admission_window=golden.get("admission_window", 0),
                       admission_threshold=golden.get("admission_threshold", 0.5))
    rp = Replay(str(trace), cfg, str(tmp_path / "run"))
    rp.step_log, rp.finished = [], []
    return rp, rp.run()


@pytest.mark.parametrize("golden_path", golden_files())
def test_same_steps_preemptions_and_hits_as_vllm_0_34(golden_path, tmp_path):
    golden = load_golden(golden_path)
    assert golden["kvbench_num_blocks"] == golden["vllm_num_gpu_blocks"] - 1
    rp, summary = replay_like_vllm(golden, tmp_path)
    ours = [step_digest([(rid, n) for rid, _, n in sched], pre) for sched, pre in rp.step_log]
    for i, (a, b) in enumerate(zip(ours, golden["step_digests"])):
        assert a == b, f"step {i} differs from vLLM's: {rp.step_log[i]}"
    assert len(ours) == golden["steps"]
    assert [[i, pre] for i, (_, pre) in enumerate(rp.step_log) if pre] == golden["preemptions"]
    assert {rs.req.id: rs.cached_tokens for rs in rp.finished} == golden["cached_tokens"]
    assert summary["preemptions"] == sum(len(p) for _, p in golden["preemptions"])
    assert summary["peak_running"] == golden["peak_running"]
    assert abs(summary["duration_s"] - golden["duration_s"]) < 1e-6 * golden["duration_s"]


def test_duplicate_key_rule_as_vllm_0_34(tmp_path):
    """vLLM's duplicate-key rule on five requests: B re-computes A's second block (a duplicate key),
    C's prompt evicts the cache, and which of the duplicates survive decides F's hit: 16 tokens."""
    golden = load_golden(DATA / "vllm-0.34-dupkey.json.gz")
    assert golden["cached_tokens"] == {"E": 0, "A": 0, "B": 16, "C": 0, "F": 16}
    rp, _ = replay_like_vllm(golden, tmp_path)
    assert {rs.req.id: rs.cached_tokens for rs in rp.finished} == golden["cached_tokens"]


def test_the_live_servers_eviction_order(tmp_path):
    """The duplicate-key rule against a running vLLM (0.32 CPU, benchmarks/live/repro_eviction_order.py,
    recorded in tests/data/live/vllm-0.32-repro-evict.json): the five requests at block 32 on 64 blocks
    (63 usable), one after another; the server cached E 0, A 0, B 32, C 0, F 32 tokens, and so does
    kvbench."""
    recorded = json.loads((DATA / "live" / "vllm-0.32-repro-evict.json").read_text())
    served = {row["step"]: row["cached_tokens"] for row in recorded if "cached_tokens" in row}
    e, a, c = list(range(1000, 1064)), list(range(2000, 2064)), list(range(3000, 4884))
    rows = [("E", e), ("A", a), ("B", a), ("C", c), ("F", e + list(range(5000, 5032)))]
    trace = tmp_path / "repro.jsonl"
    trace.write_text("".join(json.dumps({"id": rid, "t": 10 * i, "output_len": 2, "prompt": [{"tokens": toks}]}) + "\n"
                             for i, (rid, toks) in enumerate(rows)))
    assert [served[r] for r, _ in rows] == [0, 0, 32, 0, 32]
    cfg = ReplayConfig(executor="sim", model="llama-3-8b", num_blocks=63, block_size=32)
    rp = Replay(str(trace), cfg, str(tmp_path / "run"))
    rp.finished = []
    rp.run()
    assert {rs.req.id: rs.cached_tokens for rs in rp.finished} == served
