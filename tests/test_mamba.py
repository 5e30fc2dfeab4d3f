"""Recurrent-state layers (Mamba-2, Gated DeltaNet) in the KV pool, held to vLLM 0.34: the block size it
runs them at, the groups and the pool, and MambaManager's align-mode rules in small scenarios whose
answers vLLM's own scheduler gave (benchmarks/vllm_reference, driven on CPU; the whole engine against it
on real traces is tests/test_vllm_golden.py's hybrid-qwen3-next / granite goldens)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.errors import InputError
from kvbench.executors.hf_config import read_hf_config
from kvbench.executors.presets import get_model
from kvbench.memory.groups import group_layers

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model,tp,asked,checkpoints,block,page", [
    # vLLM's Platform.update_block_size_for_backend on each model's config (FlashAttention; notes'
    # table): Qwen3-Next's GDN state is 1,097,728 B, its attention 2,048 B a token a layer
    ("qwen3-next-80b-a3b", 1, 64, True, 576, 1_179_648),
    ("qwen3-next-80b-a3b", 1, 16, True, 576, 1_179_648),  # FlashInfer's GDN prefill: a multiple of 64
    ("qwen3-next-80b-a3b", 1, 16, False, 544, 1_114_112),  # the Triton GDN prefill: of 16
    ("qwen3-next-80b-a3b", 4, 64, True, 320, 327_680),
    ("qwen3-next-80b-a3b", 8, 64, True, 192, 196_608),
    ("granite-4.0-h-tiny", 1, 64, False, 448, 917_504),
    ("granite-4.0-h-tiny", 1, 16, False, 400, 819_200),
])
def test_the_block_size_is_vllms_for_the_state(model, tp, asked, checkpoints, block, page):
    m = get_model(model)
    layout = group_layers(m.kv_layers("bf16", tp, checkpoints=checkpoints), asked)
    assert layout.block_size == block and layout.page_bytes == page
    assert layout.asked_block_size == asked
    assert f"not {asked}" in layout.describe()


def test_state_shapes_are_vllms():
    qwen, granite = get_model("qwen3-next-80b-a3b"), get_model("granite-4.0-h-tiny")
    assert qwen.state_shapes(1) == ((3, 8192), (32, 128, 128)) and qwen.state_bytes(1) == 1_097_728
    assert qwen.state_bytes(2) == 548_864 and qwen.state_bytes(8) == 137_216
    assert granite.state_shapes(1) == ((3, 3328), (48, 64, 128)) and granite.state_bytes(1) == 806_400
    # Mamba-2 replicates its one group on every rank when tp does not divide the groups
    assert granite.state_shapes(2) == ((3, (3072 + 2 * 2 * 128) // 2), (24, 64, 128))


def test_groups_are_vllms():
    # vLLM's get_kv_cache_groups: the 36 GDN layers in three strided groups of 12, then the 12 full
    layout = group_layers(get_model("qwen3-next-80b-a3b").kv_layers("bf16", 1), 16)
    assert [(g.kind, len(g.layers)) for g in layout.groups] == [("mamba", 12)] * 3 + [("full", 12)]
    assert layout.groups[0].layers == tuple([i for i in range(48) if (i + 1) % 4][0::3])
    assert layout.groups[3].layers == tuple(range(3, 48, 4))
    assert layout.bytes_per_block == 12 * 1_114_112
    granite = group_layers(get_model("granite-4.0-h-tiny").kv_layers("bf16", 1), 16)
    assert [(g.kind, len(g.layers)) for g in granite.groups] == [("mamba", 4)] * 9 + [("full", 4)]


def _trace(path: Path, requests: list[tuple[str, float, list[int], int]]) -> Path:
    with open(path, "w") as fh:
        for rid, t, tokens, out in requests:
            fh.write(json.dumps({"id": rid, "t": t, "output_len": out, "prompt": [{"tokens": tokens}]}) + "\n")
    return path


def _replay(tmp_path: Path, requests, num_blocks: int = 400, **kw) -> Replay:
    trace = _trace(tmp_path / "trace.jsonl", requests)
    clock = tmp_path / "linear.json"
    clock.write_text(json.dumps({"kind": "linear", "prefill_ms_per_token": 0.1, "decode_step_ms": 20}))
    # Qwen3-Next at 576-token blocks without prefill checkpoints: what vLLM ran for these facts
    cfg = ReplayConfig(**{"executor": "sim", "model": "qwen3-next-80b-a3b", "gpu": "b200", "calibration": str(clock),
                          "num_blocks": num_blocks, "block_size": 64, **kw})
    rp = Replay(str(trace), cfg, str(tmp_path / "run"))
    rp.step_log, rp.finished = [], []
    rp.run()
    return rp


def _chunks(rp: Replay, rid: str) -> list[int]:
    return [n for sched, _ in rp.step_log for r, _, n in sched if r == rid and n > 1]


def test_a_state_is_cached_only_where_a_later_prompt_can_reach_it(tmp_path):
    """vLLM 0.34 (Qwen3-Next, block 576, retention 0), run: A (2,000 tokens) is computed in two chunks,
    1,728 then 272, and caches only its state at 1,728; B shares A's first 1,500 tokens: the full group
    hits 1,152 but no state is kept there, so B hits nothing, stops a chunk at the junction 1,152 and
    caches its state there; C, sharing the same 1,500, then hits 1,152. D is A's prompt and 1,300 more
    tokens: it hits A's 1,728. A prompt of at most 576 tokens is never cached."""
    rng = np.random.default_rng(0)
    a = rng.integers(1000, 30000, 2000).tolist()
    b = a[:1500] + rng.integers(1000, 30000, 1000).tolist()
    c = a[:1500] + rng.integers(1000, 30000, 700).tolist()
    d = a + rng.integers(1000, 30000, 1300).tolist()
    e = rng.integers(1000, 30000, 576).tolist()
    rp = _replay(tmp_path, [("A", 0, a, 3), ("B", 10, b, 3), ("C", 20, c, 3), ("D", 30, d, 3), ("E", 40, e, 3),
                            ("E2", 50, e, 3), ("A2", 60, a, 3)])
    assert rp.kv_layout.block_size == 576 and rp.cfg.block_size == 576
    hits = {rs.req.id: rs.cached_tokens for rs in rp.finished}
    assert hits == {"A": 0, "B": 0, "C": 1152, "D": 1728, "E": 0, "E2": 0, "A2": 1728}
    assert _chunks(rp, "A") == [1728, 272]
    assert _chunks(rp, "B") == [1152, 1152, 196]  # the junction, then the last boundary below 2,499
    assert _chunks(rp, "C") == [576, 472]  # from 1,152: to the last boundary (1,728), then the rest
    assert _chunks(rp, "D") == [1152, 420]  # from 1,728: to 2,880 = the boundary below 3,299, then the rest


def test_a_state_cached_in_this_step_is_hit_in_the_next(tmp_path):
    """Two identical prompts arriving together: the first caches its state at 1,152 in the step that
    computes it; the second cannot take that state in the same step (vLLM's cached_blocks_this_step) and
    is admitted one step later with the hit."""
    rng = np.random.default_rng(1)
    a = rng.integers(1000, 30000, 1200).tolist()
    rp = _replay(tmp_path, [("A", 0, a, 2), ("B", 0, a, 2)])
    hits = {rs.req.id: rs.cached_tokens for rs in rp.finished}
    first = [sorted(r for r, _, _ in sched) for sched, _ in rp.step_log]
    assert first[0] == ["A"] and hits == {"A": 0, "B": 1152}


def test_a_budget_short_of_a_block_schedules_nothing_of_a_prompt(tmp_path):
    """With 1,000 batched tokens a 2,000-token prompt goes 576 (the budget floored to a block), 576,
    576, then 272. Its states at 576 and 1,152 existed but are not kept (only the prompt's last boundary
    is): B, sharing its first 1,500 tokens, hits nothing; C, after B kept the junction, 1,152."""
    rng = np.random.default_rng(2)
    a = rng.integers(1000, 30000, 2000).tolist()
    b = a[:1500] + rng.integers(1000, 30000, 100).tolist()
    c = a[:1500] + rng.integers(1000, 30000, 100).tolist()
    rp = _replay(tmp_path, [("A", 0, a, 2), ("B", 10, b, 2), ("C", 20, c, 2)], max_batched_tokens=1000)
    assert _chunks(rp, "A") == [576, 576, 576, 272]
    assert {rs.req.id: rs.cached_tokens for rs in rp.finished} == {"A": 0, "B": 0, "C": 1152}


def test_a_request_holds_one_state_block_per_group_while_decoding(tmp_path):
    rng = np.random.default_rng(3)
    a = rng.integers(1000, 30000, 700).tolist()
    trace = _trace(tmp_path / "t.jsonl", [("A", 0, a, 600)])
    clock = tmp_path / "linear.json"
    clock.write_text(json.dumps({"kind": "linear", "prefill_ms_per_token": 0.1, "decode_step_ms": 20}))
    cfg = ReplayConfig(executor="sim", model="qwen3-next-80b-a3b", gpu="b200", calibration=str(clock),
                       num_blocks=100, block_size=64)
    rp = Replay(str(trace), cfg, str(tmp_path / "run"))
    held = []
    rp.step_hook = lambda rep, t0, t1, batch, emitted: held.append(
        [sum(b >= 0 for b in t) for t in rp.kv.group_tables(rp.sched.running[0])] if rp.sched.running else None)
    rp.run()
    states = [h[:3] for h in held if h]
    # one block per state group, two in the step that crosses a block boundary (freed at the next)
    assert max(max(s) for s in states) == 2 and sum(1 for s in states if s == [2, 2, 2]) <= 3
    assert sum(1 for s in states if s == [1, 1, 1]) >= 590
    assert max(h[3] for h in held if h) == -(-(700 + 600) // 576)  # the full group holds every token


def test_recurrent_configs_are_read_and_the_unread_refused(tmp_path):
    qwen = json.loads((ROOT / "kvbench" / "executors" / "configs" / "qwen3-next-80b-a3b.json").read_text())
    m = read_hf_config(str(ROOT / "kvbench" / "executors" / "configs" / "qwen3-next-80b-a3b.json"))
    assert m.kinds.count("mamba") == 36 and m.mamba_type == "gdn" and abs(m.num_params / 1e9 - 79.7) < 0.5
    # Qwen3.5 writes layer_types and an fp32 recurrent state
    path = tmp_path / "qwen35.json"
    path.write_text(json.dumps({**{k: v for k, v in qwen.items() if k != "full_attention_interval"},
                                "layer_types": ["linear_attention"] * 3 + ["full_attention"]
                                + ["linear_attention"] * 3 + ["full_attention"],
                                "num_hidden_layers": 8, "mamba_ssm_dtype": "float32"}))
    m35 = read_hf_config(str(path))
    assert m35.kinds.count("mamba") == 6 and m35.state_bytes(1) == 3 * 8192 * 2 + 32 * 128 * 128 * 4
    for fields, field in (({"hybrid_override_pattern": "M-M*"}, "hybrid_override_pattern"),
                          ({"layer_types": ["linear_attention"] * 48, "linear_num_key_heads": None},
                           "linear_num_key_heads")):
        path.write_text(json.dumps({**qwen, **fields}))
        with pytest.raises(InputError, match=field):
            read_hf_config(str(path))


def test_a_recurrent_model_cannot_run_as_full_attention(tmp_path):
    trace = _trace(tmp_path / "t.jsonl", [("A", 0, list(range(1000, 1100)), 2)])
    cfg = ReplayConfig(executor="sim", model="granite-4.0-h-tiny", disable_hybrid_kv_cache_manager=True)
    with pytest.raises(InputError, match="cannot run with the hybrid KV cache manager off"):
        Replay(str(trace), cfg, str(tmp_path / "run"))


PLANS = json.loads((ROOT / "benchmarks" / "vllm_reference" / "hybrid_groups.json").read_text())["plans"]


def _nemotron_h_8b():
    """Nemotron-H 8B's cache layers (hybrid_override_pattern: 24 Mamba-2, 4 attention; kvbench does not read
    the model, its MLP-only layers): a Mamba-2 state of (3, 10,240) bf16 + (128, 64, 128) fp32, 8 KV heads x 128."""
    from kvbench.memory.specs import LayerKV
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    state = LayerKV("mamba", 1, 1, 1, state_bytes=3 * 10240 * 2 + 128 * 64 * 128 * 4)
    return [state if c == "M" else LayerKV("full", 8, 128, 2) for c in pattern if c in "M*"]


@pytest.mark.parametrize("plan", [p for p in PLANS if "alignment" in p],
                         ids=lambda p: f"{p['model']}-{p['user_block_size'] or 'default'}")
def test_the_pool_for_a_memory_is_vllms_planning_block_size_included(plan):
    """vLLM's own Platform.update_block_size_for_backend and get_kv_cache_config_from_groups on each model
    (benchmarks/vllm_reference/hybrid.py plan): the block size, the groups, a block's bytes and the blocks
    1, 4 and 16 GiB buy, for the block size asked (16) and for none (vLLM then starts from 64)."""
    name = plan["model"]
    if name == "nemotron-h-8b":
        layers = _nemotron_h_8b()
    else:
        layers = get_model(name.removesuffix("-h100")).kv_layers("bf16", 1, checkpoints=name.endswith("-h100"))
    layout = group_layers(layers, plan["user_block_size"] or 64)
    assert layout.block_size == plan["block_size"] == plan["alignment"]["block_size"]
    assert [(g.kind, list(g.layers)) for g in layout.groups] == [(w["kind"], w["layers"]) for w in plan["groups"]]
    assert layout.page_bytes == plan["alignment"]["attn_page_bytes"]
    assert layout.bytes_per_block == plan["bytes_per_block"]
    for row in plan["planning"]:
        assert layout.num_blocks(row["available_bytes"]) == row["num_blocks"]


@pytest.mark.parametrize("model,tp", [("gpt-oss-120b", 1), ("gemma-3-27b", 1), ("qwen3-next-80b-a3b", 2),
                                      ("granite-4.0-h-tiny", 1)])
def test_whatif_unlimited_equals_a_replay_that_never_evicts(tmp_path, model, tp):
    """The what-if of a model in groups, with a pool that never evicts, hits what a replay of the same
    requests hits on a pool too large to evict, one request at a time (the trace slowed 100x): every
    group's caching rules, a window's and a recurrent state's sparse caching, and the split of a state's
    prefill included. (On an H200, Qwen3-Next's GDN prefill exports its checkpoints: block 576.)"""
    from kvbench.cli.trace import whatif_layout
    from kvbench.trace.format import load_trace
    from kvbench.whatif.groups import hits_per_request

    trace = str(ROOT / "traces" / "agent.jsonl")  # (its turns resend named answers)
    requests = load_trace(trace, limit=120)
    layout = whatif_layout(get_model(model), "bf16", 16, tp, "h200")
    hits, too_large = hits_per_request(requests, layout, None)
    cfg = ReplayConfig(executor="sim", model=model, tp=tp, gpu="h200", limit=120, time_scale=100.0,
                       num_blocks=1_000_000)
    rp = Replay(trace, cfg, str(tmp_path / "run"))
    rp.finished = []
    summary = rp.run()
    assert summary["peak_running"] <= 2 and summary["preemptions"] == 0 and too_large == 0
    assert rp.kv_layout == layout
    assert {rs.req.id: rs.cached_tokens for rs in rp.finished} == {r.id: h for r, h in zip(requests, hits)}
    assert 0 < sum(hits) < sum(r.prompt_len for r in requests)


def test_whatif_of_groups_evicts_and_refuses_what_it_does_not_model(capsys):
    from kvbench.cli.main import main

    chat = str(ROOT / "traces" / "chat.jsonl")
    main(["trace", "whatif", chat, "--model", "granite-4.0-h-tiny", "--budgets", "64MiB,1GiB,64GiB", "--json"])
    out = json.loads(capsys.readouterr().out)
    rates = [row["hit_rate"] for row in out["rows"]]
    assert out["block_size"] == 400 and rates[0] < rates[1] <= rates[2] == pytest.approx(out["ceiling"])
    for extra, option in ((["--policies", "lru,arc"], "--policies"), (["--prefix-mode", "radix"], "--prefix-mode"),
                          (["--replicas", "2"], "--replicas")):
        with pytest.raises(SystemExit) as e:
            main(["trace", "whatif", chat, "--model", "granite-4.0-h-tiny", *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and option in err and "mamba x 4" in err and len(err.splitlines()) == 1, err


JAMBA = {"model_type": "jamba", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 65536, "max_position_embeddings": 262144,
         "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2, "expert_layer_offset": 1,
         "num_experts": 16, "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
         "mamba_dt_rank": 256, "tie_word_embeddings": False}  # ai21labs/Jamba-v0.1's config.json
NEMOTRON_H = {"model_type": "nemotron_h", "hidden_size": 4096, "intermediate_size": 21504, "num_hidden_layers": 52,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
              "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
              "vocab_size": 131072, "max_position_embeddings": 8192, "tie_word_embeddings": False}  # Nemotron-H-8B


@pytest.mark.parametrize("cfg,layers,state,block,params", [
    # Jamba: Mamba-1, attention at i % 8 == 4, a MoE on odd layers; its state (3, 8192) + (8192, 16) bf16
    (JAMBA, (28, 4), 3 * 8192 * 2 + 8192 * 16 * 2, 80, 51.57e9),
    # Nemotron-H: 24 Mamba-2 and 4 attention blocks (the 24 MLP blocks' weights shared out over them); vLLM's
    # hook keeps the SSM state in fp32: (3, 10240) bf16 + (128, 64, 128) fp32 = 4,255,744 B, block 1,040
    (NEMOTRON_H, (24, 4), 3 * 10240 * 2 + 128 * 64 * 128 * 4, 1040, 8.10e9),
])
def test_jamba_and_nemotron_h_are_read_as_vllm_shapes_them(tmp_path, cfg, layers, state, block, params):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = read_hf_config(str(path))
    assert (m.kinds.count("mamba"), m.kinds.count("full")) == layers and m.state_bytes(1) == state
    assert group_layers(m.kv_layers("bf16", 1), 16).block_size == block
    assert m.num_params == pytest.approx(params, rel=1e-3)  # transformers' count on the meta device: 51.570e9, 8.101e9
    path.write_text(json.dumps({**cfg, **({"hybrid_override_pattern": "ME*"} if "hybrid_override_pattern" in cfg
                                          else {"attn_layer_period": 64, "attn_layer_offset": 40})}))
    with pytest.raises(InputError, match="hybrid_override_pattern|attn_layer_period"):
        read_hf_config(str(path))


def test_falcon_h1_is_refused_naming_why(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**JAMBA, "model_type": "falcon_h1", "mamba_d_ssm": 3072}))
    with pytest.raises(InputError, match="model_type.*every layer"):
        read_hf_config(str(path))


def test_parallel_samples_are_refused_on_a_recurrent_model_naming_the_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"id": "a", "t": 0, "output_len": 4, "prompt": [{"tokens": list(range(1000, 1100))}]})
                     + "\n" + json.dumps({"id": "b", "t": 1, "output_len": 4, "n": 3,
                                          "prompt": [{"tokens": list(range(2000, 2100))}]}) + "\n")
    cfg = ReplayConfig(executor="sim", model="granite-4.0-h-tiny")
    with pytest.raises(InputError, match="3 samples") as e:
        Replay(str(trace), cfg, str(tmp_path / "run"))
    assert f"{trace}:2: field 'n'" in str(e.value)
    Replay(str(trace), ReplayConfig(executor="sim", model="gpt-oss-20b"), str(tmp_path / "ok"))  # (attention: forks)


def test_external_tokens_and_the_slab_for_state_groups():
    from kvbench.memory.contracts import SeqKV
    from kvbench.memory.hybrid import HybridKV

    layout = group_layers(get_model("granite-4.0-h-tiny").kv_layers("bf16", 1), 16)
    kv = HybridKV(100, layout)
    s = SeqKV(tokens=np.arange(1000, 1900, dtype=np.int32), prompt_len=900, num_tokens=900)
    with pytest.raises(ValueError, match="recurrent state"):
        kv.allocate(s, 100, external=800)
    # a slab holds one block per state group, filled (as the paged layout counts a state)
    assert layout.slab_blocks(900) == 9 * 1 + 3 and layout.slab_live(900) == 9 * 400 + 900
