"""Several KV cache groups (kvbench.memory.groups, kvbench.memory.hybrid), held to vLLM 0.34's hybrid
KV cache manager: its grouping of real models' layers, its planning of a pool, and the rules of its
sliding-window and chunked-local managers on small cases whose answers vLLM's own code gave
(benchmarks/vllm_reference/hybrid.py; the whole engine against vLLM's scheduler is
tests/test_vllm_golden.py's hybrid goldens)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvbench.memory.contracts import SeqKV
from kvbench.memory.groups import group_layers
from kvbench.memory.hybrid import NULL, HybridKV
from kvbench.memory.specs import LayerKV
from kvbench.trace.tokens import TokenStreams

ROOT = Path(__file__).resolve().parents[1]
STREAMS = TokenStreams()


def gpt_oss_layers(dtype_bytes: int = 2) -> list[LayerKV]:
    """gpt-oss-120b: 36 layers alternating a 128-token sliding window and full attention, 8 x 64."""
    return [LayerKV("sliding" if i % 2 == 0 else "full", 8, 64, dtype_bytes, 128 if i % 2 == 0 else 0)
            for i in range(36)]


def gemma3_layers() -> list[LayerKV]:
    """Gemma 3 27B: 62 layers, five sliding-1024 to one full, 16 x 128."""
    return [LayerKV("full", 16, 128, 2) if i % 6 == 5 else LayerKV("sliding", 16, 128, 2, 1024) for i in range(62)]


def llama4_layers() -> list[LayerKV]:
    """Llama 4 Scout: 48 layers, chunked-local 8192 on three in four, the fourth full, 8 x 128."""
    return [LayerKV("full", 8, 128, 2) if i % 4 == 3 else LayerKV("chunked", 8, 128, 2, 8192) for i in range(48)]


def deepseek_layers() -> list[LayerKV]:
    return [LayerKV("mla", 1, 576, 2) for _ in range(61)]


MODELS = {"gpt-oss-120b": gpt_oss_layers, "gemma-3-27b": gemma3_layers, "llama-4-scout": llama4_layers,
          "deepseek-v3": deepseek_layers}
PLANS = json.loads((ROOT / "benchmarks" / "vllm_reference" / "hybrid_groups.json").read_text())["plans"]


def _plan(name: str, dtype: str = "auto (bf16)", disabled: bool = False) -> dict:
    return next(p for p in PLANS if p["model"] == name and p["kv_cache_dtype"] == dtype
                and p["disable_hybrid_kv_cache_manager"] == disabled)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype,disabled", [("auto (bf16)", False), ("fp8", False), ("auto (bf16)", True)])
def test_groups_and_the_pool_for_a_memory_are_vllms_planning(name, dtype, disabled):
    plan = _plan(name, dtype, disabled)
    layers = MODELS[name]()
    if dtype == "fp8":
        layers = [LayerKV(s.kind, s.num_kv_heads, s.head_size, 1, s.window) for s in layers]
    layout = group_layers(layers, 16, disable_hybrid=disabled)
    assert [(g.kind, g.window, list(g.layers)) for g in layout.groups] == \
        [(w["kind"], w["window"] or w["chunk"] or 0, w["layers"]) for w in plan["groups"]]
    assert layout.page_bytes == plan["groups"][0]["page_size_bytes"]
    assert layout.bytes_per_block == plan["bytes_per_block"]
    for row in plan["planning"]:  # vLLM's num_blocks for the memory (its null block among them)
        assert layout.num_blocks(row["available_bytes"]) == row["num_blocks"]


def _seq(tokens: np.ndarray) -> SeqKV:
    return SeqKV(tokens=tokens.astype(np.int32), prompt_len=len(tokens))


def _admit(kv: HybridKV, tokens: np.ndarray) -> tuple[int, SeqKV]:
    """Admit a whole prompt in one step as vLLM's scheduler does; -> (hit tokens, the sequence)."""
    s = _seq(tokens)
    hit = kv.lookup(s, len(tokens))
    cached = kv.num_cached_tokens(s, hit)
    assert kv.allocate(s, len(tokens) - cached, hit, must_fit=len(tokens))
    kv.commit(s, len(tokens) - cached)
    return cached, s


def _cached_positions(kv: HybridKV, s: SeqKV, g: int) -> list[int]:
    table = kv.group_tables(s)[g]
    return [j for j, b in enumerate(table) if b != NULL and kv.pool.key[b] is not None]


def test_a_sliding_window_caches_only_where_a_lookup_can_end():
    # vLLM 0.34 (gpt-oss's groups, block 16): a 500-token prompt caches the sliding group's blocks 23..30,
    # the 8 = cdiv(127, 16) a resend needs, and every full block 0..30; a resend hits 496 tokens
    kv = HybridKV(2000, group_layers(gpt_oss_layers(), 16))
    a = STREAMS.stream("A", 500)
    hit, s = _admit(kv, a)
    assert hit == 0
    assert _cached_positions(kv, s, 0) == list(range(23, 31)) and _cached_positions(kv, s, 1) == list(range(31))
    kv.free(s)
    assert _admit(kv, a)[0] == 496
    # B shares A's first 300 tokens: the full group hits 288, the sliding group nothing there: B hits 0,
    # and caches the window ending at that junction (blocks 10..17) beside its own prompt's end (29..36)
    b = np.concatenate([a[:300], STREAMS.stream("B", 300)])
    hit, s = _admit(kv, b)
    assert hit == 0 and _cached_positions(kv, s, 0) == [*range(10, 18), *range(29, 37)]
    kv.free(s)
    c = np.concatenate([a[:300], STREAMS.stream("C", 40)])
    assert _admit(kv, c)[0] == 288  # the second request to share the prefix hits it


def test_a_chat_turn_hits_up_to_the_last_prompts_boundary():
    kv = HybridKV(2000, group_layers(gpt_oss_layers(), 16))
    turn1 = STREAMS.stream("t1", 700)
    _, s = _admit(kv, turn1)
    kv.allocate(s, 1)
    kv.commit(s, 1)
    kv.free(s)
    turn2 = np.concatenate([turn1, STREAMS.stream("t2", 300)])
    assert _admit(kv, turn2)[0] == 688  # (700 - 1) // 16 * 16


def test_blocks_that_left_the_window_are_freed_as_the_sequence_grows():
    kv = HybridKV(2000, group_layers(gpt_oss_layers(), 16))
    _, s = _admit(kv, STREAMS.stream("long", 200))
    table = kv.group_tables(s)
    assert NULL not in table[0] and len(table[0]) == 13
    assert kv.allocate(s, 1)  # computed 200: 73 tokens left the window, 4 whole blocks
    assert table[0][:4] == [NULL] * 4 and NULL not in table[0][4:] and NULL not in table[1]
    used = kv.pool.num_used
    kv.free(s)
    assert kv.pool.num_used == used - (len(table[0]) - 4 + len(table[1])) == 0


def test_a_chunked_group_hits_from_its_chunk_start():
    layers = [LayerKV("full", 2, 16, 2), LayerKV("chunked", 2, 16, 2, 64)] * 2
    kv = HybridKV(2000, group_layers(layers, 16))
    a = STREAMS.stream("a", 150)
    _, s = _admit(kv, a)
    kv.free(s)
    assert _admit(kv, a)[0] == 144  # the full group's hit; the chunked group's from block 8 (128 / 16)
    b = np.concatenate([a[:100], STREAMS.stream("b", 60)])
    hit, s = _admit(kv, b)
    assert hit == 96 and kv.group_tables(s)[1][:4] == [NULL] * 4  # chunk 64..127: blocks 0-3 never held


def test_a_chunked_hit_needs_nothing_before_its_chunk():
    # a running sequence past a chunk boundary frees its earlier chunk's blocks; once they are evicted,
    # a prompt ending in the same chunk still hits: its chunked group needs only its own chunk's blocks
    layers = [LayerKV("full", 2, 16, 2), LayerKV("chunked", 2, 16, 2, 64)] * 2
    kv = HybridKV(20, group_layers(layers, 16))
    a = STREAMS.stream("a", 150)
    _, s = _admit(kv, a)
    assert kv.allocate(s, 1) and kv.group_tables(s)[1][:8] == [NULL] * 8  # blocks 0-7 left the chunk
    kv.commit(s, 1)
    evicted = kv.pool.evictions
    _admit(kv, STREAMS.stream("filler", 64))  # takes the 8 cached blocks
    assert kv.pool.evictions == evicted + 8
    b = np.concatenate([a[:140], STREAMS.stream("b", 30)])
    assert kv.probe_cached_tokens(_seq(b), len(b)) == 128


def test_admission_counts_a_windowed_group_at_most_its_cap():
    layout = group_layers(gpt_oss_layers(), 16)
    kv = HybridKV(649, layout, max_batched_tokens=256)
    cap = layout.groups[0].admission_cap(16, 256, 1 << 30)
    assert cap == -(-(127 + 256) // 16) + 1 == 25
    s = _seq(STREAMS.stream("big", 10_000))
    hit = kv.lookup(s, 10_000)
    # the full group needs all 625 blocks of the prompt, the sliding one at most its cap
    assert not kv.allocate(s, 256, hit, must_fit=10_000) and kv.last_shortfall == 625 + 25
    assert HybridKV(650, layout, max_batched_tokens=256).allocate(s, 256, hit, must_fit=10_000)


def test_free_order_and_the_pools_counters_hold_over_a_random_mix():
    rng = np.random.default_rng(0)
    kv = HybridKV(400, group_layers(gemma3_layers()[:12], 16), max_batched_tokens=512)
    seqs = []
    for i in range(60):
        base = STREAMS.stream(f"p{int(rng.integers(4))}", int(rng.integers(20, 300)))
        tokens = np.concatenate([base, STREAMS.stream(f"u{i}", int(rng.integers(1, 40)))])
        s = _seq(tokens)
        hit = kv.lookup(s, len(tokens))
        cached = kv.num_cached_tokens(s, hit)
        if kv.allocate(s, len(tokens) - cached, hit, must_fit=len(tokens)):
            kv.commit(s, len(tokens) - cached)
            seqs.append(s)
        if seqs and rng.random() < 0.5:
            kv.free(seqs.pop(int(rng.integers(len(seqs)))))
        assert kv.pool.recount()["num_used"] == kv.pool.num_used
        assert kv.pool.recount()["tokens_live"] == kv.pool.tokens_live
    for s in seqs:
        kv.free(s)
    assert kv.pool.num_used == 0 and kv.pool.tokens_live == 0


def test_a_hybrid_slab_reserves_each_groups_slots():
    from kvbench.memory.slab import SlabKV

    layout = group_layers(gpt_oss_layers(), 16)
    assert layout.slab_blocks(8192) == 512 + 8  # the full group's 8,192 slots, the sliding one's ring of 128
    slab = SlabKV(1100, 16, kv_layout=layout)
    seqs = [SeqKV(reserve=8192) for _ in range(3)]
    assert slab.allocate(seqs[0], 200) and slab.allocate(seqs[1], 200)
    assert not slab.allocate(seqs[2], 200)  # 1,100 blocks hold two slabs of 520
    slab.commit_all(seqs[:2], [200, 200])
    assert slab.stats().tokens_live == 2 * (200 + 128)  # every token in the full group, the last 128 in the window
    slab.commit(seqs[0], 1)
    assert slab.stats().tokens_live == 2 * 328 + 1
    slab.free(seqs[0])
    assert slab.stats().tokens_live == 328 and slab.stats().blocks_used == 520


@pytest.mark.parametrize("hybrid", [True, False])
def test_blocks_computed_elsewhere_are_taken_as_computed(hybrid):
    """vLLM allocate_slots' external tokens (a KV connector's load): after the local hit, their blocks
    are allocated holding KV and cached; a window's blocks it already left get none."""
    from kvbench.memory.paged import PagedKV

    layers = gpt_oss_layers() if hybrid else [LayerKV("full", 8, 64, 2)] * 4
    kv = HybridKV(500, group_layers(layers, 16)) if hybrid else PagedKV(500, 16, compiled=False)
    a = STREAMS.stream("ext", 400)
    s = _seq(a)
    hit = kv.lookup(s, 400)
    assert kv.num_cached_tokens(s, hit) == 0
    assert kv.allocate(s, 1, hit, external=399, must_fit=400)  # the prompt's KV but its last token loaded
    assert s.num_kv == 399
    if hybrid:
        sliding, full = kv.group_tables(s)
        # 399 tokens computed: the next sees 272..399, so blocks 0-16 were left before they were ever held
        assert sliding[:17] == [NULL] * 17 and NULL not in sliding[17:] and NULL not in full
    kv.commit(s, 1)
    assert kv.stats().tokens_live == (400 + 128 if hybrid else 400)  # (the window's blocks hold tokens 272..399)
    kv.free(s)
    again = _seq(a)
    # what was loaded is cached; but the resend's window needs block 16, which the load never held
    # (vLLM too: a window's run must reach the hit's end), so the sliding group hits nothing
    assert kv.num_cached_tokens(again, kv.lookup(again, 400)) == (0 if hybrid else 384)


def test_a_hybrid_run_names_its_groups_and_the_report_reads_it(tmp_path):
    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.replay import replay
    from kvbench.report.html import build_report

    cfg = ReplayConfig(executor="sim", model="gpt-oss-120b", limit=12, kv_mem="1GiB", max_model_len=8192)
    summary = replay(str(ROOT / "traces" / "chat.jsonl"), cfg, str(tmp_path / "run"))
    assert summary["kv_cache_groups"] == "sliding 128 x 18, full x 18 (589,824 B a block)"
    assert summary["num_blocks"] == 1820 and summary["kv_bytes_per_block"] == 589_824  # vLLM's planning for 1 GiB
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert [(g["kind"], g["layers"], g["bytes_per_token"]) for g in config["kv_cache_groups"]["groups"]] == \
        [("sliding", 18, 36_864), ("full", 18, 36_864)]
    rep = build_report([str(tmp_path / "run")], str(tmp_path / "rep"))
    assert rep.charts and not rep.skipped


def test_replicas_run_a_hybrid_model_each_on_its_groups(tmp_path):
    """Each replica keeps the model's groups; the kv-aware router's index hears the full group's keys
    (a sliding window's are salted apart), so it predicts more hits than the windows allow."""
    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.replay import Replay

    cfg = ReplayConfig(executor="sim", model="gpt-oss-120b", limit=60, kv_mem="1GiB", max_model_len=8192,
                       replicas=2, router="kv-aware", time_scale=0.05)
    rp = Replay(str(ROOT / "traces" / "chat.jsonl"), cfg, str(tmp_path / "run"))
    summary = rp.run()
    assert all(isinstance(r.kv, HybridKV) for r in rp.replicas) and summary["completed"] == 60
    assert 0 < summary["router_hit_blocks"] <= summary["router_predicted_blocks"]


def test_vllms_default_turns_the_hybrid_manager_off_for_chunked_local_attention():
    """vLLM 0.34 (VllmConfig.__post_init__) runs a model with chunked local attention with its hybrid
    manager off unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1; every other hybrid model on."""
    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.setup import kv_layout_of
    from kvbench.executors import make_executor
    from kvbench.executors.presets import get_model

    def groups(model: str, disable: bool | None, tp: int = 1) -> list[tuple[str, int]]:
        cfg = ReplayConfig(executor="sim", model=model, tp=tp, disable_hybrid_kv_cache_manager=disable).validate()
        return [(g.kind, len(g.layers)) for g in kv_layout_of(cfg, make_executor(cfg, get_model(model))).groups]

    assert groups("llama-4-scout", None, 4) == [("full", 48)]
    assert groups("llama-4-scout", False, 4) == [("chunked", 12)] * 3 + [("full", 12)]
    assert groups("gpt-oss-120b", None) == [("sliding", 18), ("full", 18)]
    assert groups("gpt-oss-120b", True) == [("full", 36)]
