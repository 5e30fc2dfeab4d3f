"""kvbench's engine against vLLM 0.33's own scheduler (benchmarks/vllm_reference: vLLM's Scheduler and
KVCacheManager driven without a model on the same trace and the same linear clock): on the first 2,000
requests of the real Mooncake conversation trace, every step schedules the same requests with the same
token counts and preempts the same requests, and every request hits the same prefix tokens."""
from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.trace.importers import convert

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "vllm-0.33-mooncake2000.json.gz"
MOONCAKE = ROOT.parent / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"


def step_digest(sched: list, preempted: list) -> str:
    """A short digest of one step: scheduled (request id, tokens) in order, then preempted ids in order."""
    text = json.dumps([[[str(r), int(n)] for r, n in sched], [str(r) for r in preempted]], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@pytest.mark.skipif(not MOONCAKE.exists(), reason="the real Mooncake trace is not beside the checkout")
def test_same_steps_preemptions_and_hits_as_vllm_0_33(tmp_path):
    golden = json.loads(gzip.open(GOLDEN, "rt", encoding="utf-8").read())
    trace = tmp_path / "mooncake.jsonl"
    convert("mooncake", str(MOONCAKE), str(trace), limit=golden["cached_tokens"].__len__())
    clock = tmp_path / "linear.json"
    clock.write_text(json.dumps(golden["clock"]))
    cfg = ReplayConfig(executor="sim", model="llama-3-8b", calibration=str(clock),
                       num_blocks=golden["kvbench_num_blocks"], block_size=golden["block_size"],
                       max_num_seqs=golden["max_num_seqs"], max_batched_tokens=golden["max_batched_tokens"])
    rp = Replay(str(trace), cfg, str(tmp_path / "run"))
    rp.step_log, rp.finished = [], []
    summary = rp.run()
    ours = [step_digest([(rid, n) for rid, _, n in sched], pre) for sched, pre in rp.step_log]
    for i, (a, b) in enumerate(zip(ours, golden["step_digests"])):
        assert a == b, f"step {i} differs from vLLM's: {rp.step_log[i]}"
    assert len(ours) == golden["steps"] == 15331
    assert [[i, pre] for i, (_, pre) in enumerate(rp.step_log) if pre] == golden["preemptions"]
    assert {rs.req.id: rs.cached_tokens for rs in rp.finished} == golden["cached_tokens"]
    assert summary["preemptions"] == 38 and summary["peak_running"] == golden["peak_running"] == 79
    assert abs(summary["duration_s"] - golden["duration_s"]) < 1e-6 * golden["duration_s"]
