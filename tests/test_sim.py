"""The sim executor's per-operation roofline (kvbench/executors/sim.py) against FLOPs and bytes worked
out by hand, its GPU presets against the datasheets, tensor parallelism and the memory checks.

Every figure below was worked out from the published shapes, not from kvbench's code:
  Llama-3-8B   L=32 h=4096 Hq=32 Hkv=8 d=128 I=14336 V=128256
  Llama-3-70B  L=80 h=8192 Hq=64 Hkv=8 d=128 I=28672 V=128256   (GQA-8)
bf16 weights and KV (2 bytes). Per GPU at tensor parallelism N: hq = Hq/N, hkv = Hkv/N (1 when N > Hkv),
  W_attn = h hq d + 2 h hkv d + hq d h,  W_mlp = 3 h I / N,  kv = 2 L hkv d 2,  W_head = h V / N.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.engine.setup import pool_blocks
from kvbench.errors import InputError
from kvbench.executors.presets import GPUS, MODELS, get_gpu, get_model
from kvbench.executors.sim import OPERATIONS, CostModel, SimExecutor, StepCost, make_sim
from kvbench.scheduler.batch import StepBatch

ROOT = Path(__file__).resolve().parents[1]

# (model, N) -> W_attn, W_mlp, kv bytes per token per GPU, W_head (elements per GPU), worked by hand:
#   8B  N=1: 4096*4096 + 2*4096*1024 + 4096*4096 = 41,943,040;  3*4096*14336 = 176,160,768;
#            2*32*8*128*2 = 131,072 (128 KiB);  4096*128256 = 525,336,576
#   70B N=1: 8192*8192*2 + 2*8192*1024 = 150,994,944;  3*8192*28672 = 704,643,072;  2*80*8*128*2 = 327,680
#            (320 KiB, design.md);  8192*128256 = 1,050,673,152
SHAPES = {
    ("llama-3-8b", 1): (41_943_040, 176_160_768, 131_072, 525_336_576),
    ("llama-3-8b", 2): (20_971_520, 88_080_384, 65_536, 262_668_288),
    ("llama-3-8b", 4): (10_485_760, 44_040_192, 32_768, 131_334_144),
    ("llama-3-70b", 1): (150_994_944, 704_643_072, 327_680, 1_050_673_152),
    ("llama-3-70b", 2): (75_497_472, 352_321_536, 163_840, 525_336_576),
    ("llama-3-70b", 4): (37_748_736, 176_160_768, 81_920, 262_668_288),
}
LAYERS = {"llama-3-8b": (32, 4096, 128), "llama-3-70b": (80, 8192, 128)}  # L, h, d
QUERY_HEADS = {"llama-3-8b": 32, "llama-3-70b": 64}

# The three steps: (cached prefix, chunk length, chunk ends the prompt) per chunk; context per decode.
STEPS = {
    "prefill": ([(1024, 512, True)], []),  # a chunk after a cached prefix of 1024
    "decode": ([], [4096] * 64),  # 64 decodes at 4k context
    "mixed": ([(0, 256, False)], [2048] * 32),  # a mid-prompt chunk (samples nothing) + 32 decodes at 2k
}


def batch_of(chunks, decodes, block_size=16) -> StepBatch:
    b = StepBatch(block_size=block_size)
    for i, (start, n, last) in enumerate(chunks):
        b.prefill_seq_ids.append(i)
        b.prefill_starts.append(start)
        b.prefill_lens.append(n)
        b.prefill_last.append(last)
    for j, ctx in enumerate(decodes):
        b.decode_seq_ids.append(100 + j)
        b.decode_positions.append(ctx - 1)
    return b


def expected(model: str, tp: int, step: str) -> dict:
    """The step's work per GPU from the hand-worked shapes above."""
    w_attn, w_mlp, kv, w_head = SHAPES[(model, tp)]
    L, h, d = LAYERS[model]
    hq = QUERY_HEADS[model] // tp
    chunks, decodes = STEPS[step]
    t = sum(n for _, n, _ in chunks) + len(decodes)
    s = len(decodes) + sum(last for *_, last in chunks)
    return {
        "linear_flops": 2 * t * L * (w_attn + w_mlp), "linear_bytes": 2 * L * (w_attn + w_mlp),
        "prefill": [(4 * L * hq * d * (n * s0 + n * (n + 1) / 2), kv * (s0 + n)) for s0, n, _ in chunks],
        "decode_flops": 4 * L * hq * d * sum(decodes), "decode_bytes": kv * sum(decodes),
        "lm_head_flops": 2 * s * w_head if s else 0, "lm_head_bytes": 2 * w_head if s else 0,
        "kv_write_bytes": kv * t + 2 * t * h,
        "allreduces": 2 * L if tp > 1 else 0, "allreduce_bytes": t * h * 2 if tp > 1 else 0,
    }


def work_dict(w) -> dict:
    return {k: getattr(w, k) for k in ("linear_flops", "linear_bytes", "prefill", "decode_flops", "decode_bytes",
                                       "lm_head_flops", "lm_head_bytes", "kv_write_bytes", "allreduces",
                                       "allreduce_bytes")}


@pytest.mark.parametrize("model", ["llama-3-8b", "llama-3-70b"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("step", list(STEPS))
def test_work_of_each_operation_matches_the_hand_computed_figures(model, tp, step):
    got = work_dict(StepCost(MODELS[model], tp).work(batch_of(*STEPS[step])))
    want = expected(model, tp, step)
    for key in want:
        if key == "prefill":
            assert [pytest.approx(c, rel=1e-12) for c in want[key]] == got[key]
        else:
            assert got[key] == pytest.approx(want[key], rel=1e-12), key


def test_llama_3_8b_figures_written_out():
    """The three Llama-3-8B steps at N=1 with every figure written out, no formula in between."""
    cost = StepCost(MODELS["llama-3-8b"])
    pre = work_dict(cost.work(batch_of(*STEPS["prefill"])))
    assert pre["linear_flops"] == 7_146_825_580_544 and pre["linear_bytes"] == 13_958_643_712
    assert pre["prefill"] == [(343_731_601_408, 201_326_592)]  # 1024 cached + 512 new tokens of KV read
    assert (pre["lm_head_flops"], pre["lm_head_bytes"]) == (1_050_673_152, 1_050_673_152)  # one sampled row
    assert pre["kv_write_bytes"] == 71_303_168 and pre["decode_bytes"] == 0 and pre["allreduces"] == 0
    dec = work_dict(cost.work(batch_of(*STEPS["decode"])))
    assert dec["linear_flops"] == 893_353_197_568 and dec["linear_bytes"] == 13_958_643_712
    assert (dec["decode_flops"], dec["decode_bytes"]) == (137_438_953_472, 34_359_738_368)  # 32 GiB of KV
    assert dec["lm_head_flops"] == 67_243_081_728 and dec["kv_write_bytes"] == 8_912_896
    mix = work_dict(cost.work(batch_of(*STEPS["mixed"])))
    assert mix["prefill"] == [(17_246_978_048, 33_554_432)]
    assert (mix["decode_flops"], mix["decode_bytes"]) == (34_359_738_368, 8_589_934_592)
    assert mix["lm_head_flops"] == 33_621_540_864  # the 32 decodes only: the chunk ends no prompt


def test_llama_3_70b_tp4_figures_written_out():
    cost = StepCost(MODELS["llama-3-70b"], tp=4)
    dec = work_dict(cost.work(batch_of(*STEPS["decode"])))
    assert dec["linear_bytes"] == 34_225_520_640  # a quarter of 136.9 GB of layer weights
    assert (dec["decode_flops"], dec["decode_bytes"]) == (171_798_691_840, 21_474_836_480)
    assert (dec["allreduces"], dec["allreduce_bytes"]) == (160, 1_048_576)  # 2 x 80 layers, 64 x 8192 x 2
    pre = work_dict(cost.work(batch_of(*STEPS["prefill"])))
    assert pre["prefill"] == [(429_664_501_760, 125_829_120)] and pre["allreduce_bytes"] == 8_388_608


def test_step_time_is_the_sum_of_each_operations_roofline():
    """Llama-3-70B at N=2 on the H200 preset: each operation's max(FLOPs / rate, bytes / bandwidth) by
    hand, with the fitted defaults written out (989.5 TFLOP/s x 0.667, attention x 0.707 on its ramp;
    4.8 TB/s x 0.831; NVLink 450 GB/s
    x 0.8; 31.9 us per all-reduce; 1.35 ms per step and 77.3 us per scheduled sequence: the chunk and 32
    decodes)."""
    ex = make_sim(MODELS["llama-3-70b"], GPUS["h200"], tp=2)
    rate, bw, link = 989.5e12 * 0.667, 4.8e12 * 0.831, 450e9 * 0.8
    attn = 989.5e12 * 0.707  # attention: FlashAttention's plateau, the 256-token chunk on its ramp
    b = batch_of(*STEPS["mixed"])
    got = ex.breakdown(b)
    assert got["linear"] == pytest.approx(max(19_713_899_888_640 / rate, 68_451_041_280 / bw))
    assert got["prefill"] == pytest.approx(max(43_117_445_120 / (attn * -math.expm1(-256 / 1395)), 41_943_040 / bw))
    assert got["decode"] == pytest.approx(max(85_899_345_920 / attn, 10_737_418_240 / bw))
    assert got["lm_head"] == pytest.approx(max(33_621_540_864 / rate, 1_050_673_152 / bw))
    assert got["kv_write"] == pytest.approx(51_904_512 / bw)
    assert got["allreduce"] == pytest.approx(160 * (31.9e-6 + 2 * 1 / 2 * 4_718_592 / link))
    assert got["overhead"] == pytest.approx(1.35e-3 + 33 * 77.3e-6)
    assert got["launch"] == 0 and got["per_token"] == 0  # CUDA graphs; a preset has no linear terms
    assert got["pcie"] == 0 and tuple(got) == OPERATIONS
    assert ex.step_time(b) == pytest.approx(sum(got.values()))
    # a ring all-reduce moves 2 (N - 1) / N of the message per GPU: 1 at N=2, 1.5 at N=4
    tp4 = make_sim(MODELS["llama-3-70b"], GPUS["h200"], tp=4).breakdown(b)
    assert tp4["allreduce"] == pytest.approx(160 * (31.9e-6 + 2 * 3 / 4 * 4_718_592 / link))


def test_llama_31_8b_decodes_at_batch_one_as_vllm_measures():
    """The issue's case: Llama-3.1-8B bf16 on one H100 SXM at batch 1, 1,024 in / 128 out, decoding
    token 1,100: 15.01 GB of weights (32 layers x 218,103,808 + the 525,336,576-weight LM head, 2 bytes
    each) at 3.35 TB/s x 0.831 take 5.39 ms; its 1,100 keys (131,072 bytes each) 0.05 ms; one step
    1.35 ms and one sequence 0.077 ms: 6.87 ms, where vLLM measures about 6.5 (the sim said 9.3 with a
    fixed 4 ms per step)."""
    ex = make_sim(MODELS["llama-3.1-8b"], GPUS["h100"])
    bw = 3.35e12 * 0.831
    weights = 2 * (32 * 218_103_808 + 525_336_576)
    kv = 1100 * 131_072 + 131_072 + 2 * 4096  # read 1,100 keys; write one token's K, V and embedding row
    want = weights / bw + kv / bw + 1.35e-3 + 77.3e-6
    assert ex.step_time(batch_of([], [1100])) == pytest.approx(want, rel=1e-9)
    assert 6.8e-3 < want < 7.0e-3


# FlashAttention-3's causal forward on an H100, bf16, B=4, H=48, D=128 (tritonbench PR #1267, "Causal
# Forward", column FA3): microseconds at S = 1k, 2k, 4k and 8k tokens.
FA3_H100_CAUSAL_US = {1024: 141.63, 2048: 368.35, 4096: 1236.90, 8192: 4817.44}


@pytest.mark.parametrize("s", sorted(FA3_H100_CAUSAL_US))
def test_prefill_attention_runs_at_flashattentions_published_rate(s):
    """A fresh causal prefill of S tokens on the H100 preset computes attention at the rate FA3 was
    measured at for S (4 B H S^2 D / 2 FLOPs in the printed time), within 5%: the rate rises from 364
    TFLOP/s at 1k to 685 at 8k, where one fitted share of the peak (0.462 before) missed both ends."""
    measured = 4 * 4 * 48 * s * s * 128 / 2 / (FA3_H100_CAUSAL_US[s] * 1e-6)
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h100"])
    w = ex.work(batch_of([(0, s, True)], []))
    (flops, _), = w.prefill
    assert flops == 4 * 32 * 32 * 128 * s * (s + 1) / 2  # 4 L hq d x the causal pairs
    rate = flops / ex.breakdown(batch_of([(0, s, True)], []))["prefill"]
    assert rate == pytest.approx(measured, rel=0.05)


def test_a_chunk_after_cached_tokens_is_priced_on_its_whole_span():
    """A chunk of n tokens after s cached ones runs as a causal prefill of 2 s + n: 512 new tokens after
    3,840 cached reach the 8k rate, not the 512-token one."""
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h100"])
    b = batch_of([(3840, 512, True)], [])
    w = ex.work(b)
    assert w.prefill_span == [2 * 3840 + 512]
    (flops, read), = w.prefill
    c = ex.cost
    want = max(flops / (c.attn_flops * -math.expm1(-8192 / c.attn_ramp_tokens)), read / c.kv_bw)
    assert ex.breakdown(b)["prefill"] == pytest.approx(want, rel=1e-12)
    flat = CostModel(**{**c.to_dict(), "attn_ramp_tokens": 0.0})  # a calibration's rate: flat
    assert w.seconds(flat)["prefill"] == pytest.approx(max(flops / c.attn_flops, read / c.kv_bw), rel=1e-12)


def test_a_calibrated_attention_rate_is_flat(tmp_path):
    """A calibration file that measures attention gives its rate whatever the span (the ramp is the GPU
    kernels'); one that does not keeps the preset's rate and its ramp."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"coefficients": {"attn_flops": 1e12}}))
    assert make_sim(MODELS["tiny"], GPUS["h100"], calibration=str(cal)).cost.attn_ramp_tokens == 0
    cal.write_text(json.dumps({"coefficients": {"mem_bw": 1e12}}))
    assert make_sim(MODELS["tiny"], GPUS["h100"], calibration=str(cal)).cost.attn_ramp_tokens == \
        get_gpu("h100").attn_ramp_tokens > 0


def test_each_request_pays_the_api_servers_front_end(tmp_path):
    """On a GPU preset a request spends request_s + request_token_s x its prompt in the API server, then
    request_latency_s, before the engine sees it: one request's TTFT is the engine's plus exactly that;
    --no-front-end (vLLM's offline LLM class) takes it away. The server takes requests one at a time: a
    burst of 200 short prompts reaches the engine over 200 services, so the burst lasts at least that
    long."""
    from kvbench.executors import presets
    from kvbench.trace.format import write_trace
    from kvbench.workloads import WORKLOADS, Common, generate

    def run(name, n, ilen, **kw):
        trace = tmp_path / f"{name}.jsonl"
        params = WORKLOADS["random"].params(input_len=ilen, output_len=4)
        write_trace(generate(WORKLOADS["random"], Common(requests=n, seed=0), params), str(trace))
        return Replay(str(trace), ReplayConfig(executor="sim", model="qwen3-0.6b", gpu="h100", **kw).validate(),
                      str(tmp_path / name)).run()
    on, off = run("on", 1, 1000), run("off", 1, 1000, front_end=False)
    service = presets.REQUEST_S + presets.REQUEST_TOKEN_S * 1000
    assert on["ttft_ms_p50"] - off["ttft_ms_p50"] == pytest.approx((service + presets.REQUEST_LATENCY_S) * 1e3,
                                                                   rel=1e-9)
    assert service + presets.REQUEST_LATENCY_S > 5e-3  # a few ms: what makes TTFT at low load
    burst = run("burst", 200, 16)
    assert burst["duration_s"] >= 200 * (presets.REQUEST_S + presets.REQUEST_TOKEN_S * 16)
    assert run("burst-offline", 200, 16, front_end=False)["duration_s"] < 0.5 * burst["duration_s"]


def test_decode_kv_reads_are_not_hidden_inside_a_big_prefill_chunk():
    """The issue's case: 256 decodes at 8k context beside an 8k prefill chunk of Llama-3-8B on an H200.
    One max over the whole step hid their KV reads (~69 ms) behind the chunk's compute; per operation
    they add their own time."""
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h200"])
    chunk = batch_of([(0, 8192, True)], [])
    both = batch_of([(0, 8192, True)], [8192] * 256)
    kv_read_s = 256 * 8192 * 131_072 / (4.8e12 * 0.831)  # 275 GB of KV
    assert kv_read_s > 0.06
    assert ex.step_time(both) - ex.step_time(chunk) >= kv_read_s


def test_decode_step_time_rises_with_context_as_the_kv_bytes_predict():
    """H200 preset, Llama-3-8B, a batch of 64: from 1k to 4k to 16k context each step adds exactly its
    extra KV bytes at the KV bandwidth (the README's table)."""
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h200"])
    times = {c: ex.step_time(batch_of([], [c] * 64)) for c in (1024, 4096, 16384)}
    kv_bw = 4.8e12 * 0.831
    for lo, hi in ((1024, 4096), (4096, 16384)):
        extra_bytes = 64 * (hi - lo) * 131_072  # KV read grows with context
        assert times[hi] - times[lo] == pytest.approx(extra_bytes / kv_bw, rel=1e-9)
    assert times[16384] > 2 * times[1024]


def test_kv_heads_that_do_not_divide_tp_are_replicated():
    """Llama-3-8B at N=16: 8 KV heads over 16 GPUs, one replica each (vLLM); the pool pays for every copy."""
    cost = StepCost(MODELS["llama-3-8b"], tp=16)
    assert cost.hq == 2 and cost.hkv == 1
    assert cost.kv_tok == 2 * 32 * 1 * 128 * 2  # 16,384 bytes per GPU
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h200"], tp=16)
    assert ex.kv_bytes_per_token() == 16 * 16_384 == 2 * MODELS["llama-3-8b"].kv_bytes_per_token()
    w = cost.work(batch_of([], [100]))
    assert w.decode_bytes == 100 * 16_384 and w.decode_flops == 4 * 32 * 2 * 128 * 100
    assert cost.w_attn == 4096 * 256 + 2 * 4096 * 128 + 256 * 4096
    with pytest.raises(InputError, match="--tp"):
        StepCost(MODELS["llama-3-8b"], tp=3)  # 32 query heads
    with pytest.raises(InputError, match="--tp"):
        StepCost(MODELS["llama-3-8b"], tp=12)  # neither divides nor is a multiple of 8 KV heads... nor of 32
    with pytest.raises(InputError, match="--tp"):
        StepCost(MODELS["llama-3-8b"], tp=0)


# Each preset's datasheet (the comment beside it in presets.py names it): memory (GB = 10^9 bytes),
# memory bandwidth, dense bf16 and fp8 tensor-core FLOP/s (the "with sparsity" figures halved; None: no
# fp8 tensor cores), GPU-to-GPU and host bytes/s per direction.
DATASHEETS = {
    "h200": (141e9, 4.8e12, 989.5e12, 1979e12, 450e9, 64e9),
    "h100": (80e9, 3.35e12, 989.5e12, 1979e12, 450e9, 64e9),
    "a100": (80e9, 2.039e12, 312e12, None, 300e9, 32e9),
    "a100-40gb": (40e9, 1.555e12, 312e12, None, 300e9, 32e9),
    "l40s": (48e9, 864e9, 362.05e12, 733e12, 32e9, 32e9),  # no NVLink: PCIe Gen4 x16
    "l4": (24e9, 300e9, 121e12, 242.5e12, 32e9, 32e9),  # 242 / 485 TFLOPS with sparsity; PCIe Gen4
    "b200": (180e9, 8e12, 2250e12, 4500e12, 900e9, 64e9),  # DGX B200 / 8: 1,440 GB, 64 TB/s, 72 PF fp8 sparse
    "h20": (96e9, 4.0e12, 148e12, 296e12, 450e9, 64e9),
    "mi300x": (192e9, 5.3e12, 1307.4e12, 2614.9e12, 448e9, 64e9),  # 7 Infinity Fabric links x 64 GB/s
}


@pytest.mark.parametrize("name", list(DATASHEETS))
def test_presets_are_the_datasheets_with_one_derating(name):
    """Every preset is its datasheet, derated by the same fitted factor per resource."""
    mem, bw, bf16, fp8, link, pcie = DATASHEETS[name]
    g = get_gpu(name)
    assert (g.mem_bytes, g.peak_mem_bw, g.peak_bf16_flops, g.peak_fp8_flops) == (mem, bw, bf16, fp8)
    assert (g.peak_link_bw, g.peak_pcie_bw) == (link, pcie)
    assert g.mem_bw == pytest.approx(bw * 0.831) and g.kv_bw == g.mem_bw
    assert g.matmul_flops == pytest.approx(bf16 * 0.667) and g.attn_flops == pytest.approx(bf16 * 0.707)
    assert g.matmul_rate("fp8") == pytest.approx((fp8 or bf16) * 0.667)  # no fp8 tensor cores: bf16's
    assert g.link_bw == pytest.approx(link * 0.8) and g.pcie_bw == pytest.approx(pcie * 0.8)
    assert (g.step_overhead_s, g.seq_overhead_s, g.allreduce_latency_s) == (1.35e-3, 77.3e-6, 31.9e-6)


def test_every_preset_is_checked_against_its_datasheet():
    assert set(GPUS) == set(DATASHEETS)
    assert get_gpu("A100") is get_gpu("a100") and get_gpu("a100").mem_bytes == 80e9  # a100 stays the 80 GB SXM


def test_default_pool_is_the_gpu_memory_left_after_weights_and_activations():
    """Llama-3-8B on one H200: 0.9 x 141e9 - 16.06 GB of weights - activations of an 8192-token step."""
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h200"])
    weights = 2 * (32 * (41_943_040 + 176_160_768 + 2 * 4096) + 2 * 525_336_576 + 4096)
    assert weights == 16_060_522_496
    acts = 2 * 8192 * (2 * 4096 + 3 * 14336) + 4 * 256 * 128256
    assert ex.default_kv_bytes() == int(0.9 * 141e9 - weights - acts)
    assert ex.default_kv_bytes() > 109e9  # GB, not GiB: 7% more than 0.9 x 131.3 GiB would give
    tp4 = make_sim(MODELS["llama-3-70b"], GPUS["h100"], tp=4)
    per_gpu = 0.9 * 80e9 - 2 * (80 * (37_748_736 + 176_160_768 + 2 * 8192) + 2 * 262_668_288 + 8192) \
        - (2 * 8192 * (2 * 8192 + 3 * 28672 / 4) + 4 * 256 * 128256)
    assert tp4.default_kv_bytes() == int(4 * per_gpu)
    assert tp4.kv_bytes_per_token() == 4 * 81_920 == MODELS["llama-3-70b"].kv_bytes_per_token()


def test_weights_that_do_not_fit_name_the_fix():
    """The fix named is the smallest --tp whose pool also holds one sequence of the model's context (as
    vLLM requires): Llama-3-70B (320 KiB of KV per token, 131,072 tokens: 42.9 GB) on H100s needs 4, as
    at 2 each GPU keeps 72 - 70.6 (weights) - 1.1 (activations) = 0.3 GB; on L40Ss 8, as at 4 each
    keeps 43.2 - 35.3 - 0.8 = 7.1 GB, under the 10.7 GB a quarter of that sequence takes."""
    with pytest.raises(InputError, match=r"--tp 2\b"):
        make_sim(MODELS["llama-3-70b"], GPUS["h200"])  # 141 GB of weights on a 141 GB GPU
    with pytest.raises(InputError, match=r"--tp 4\b"):
        make_sim(MODELS["llama-3-70b"], GPUS["h100"])
    make_sim(MODELS["llama-3-70b"], GPUS["h100"], tp=2)  # fits, with a pool too small to be of use
    with pytest.raises(InputError, match=r"--tp 8\b"):
        make_sim(MODELS["llama-3-70b"], GPUS["l40s"], tp=2)
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h100"])
    with pytest.raises(InputError, match="--kv-mem"):
        ex.check_kv_bytes(60 * 10**9)  # 16 GB of weights + 60 GB of KV > 72 GB usable
    ex.check_kv_bytes(50 * 10**9)


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cli_70b_runs_on_four_h100s_and_asks_for_tp_without(tmp_path):
    r = _cli("replay", "traces/chat.jsonl", "--executor", "sim", "--model", "llama-3-70b", "--gpu", "h100",
             "--tp", "4", "--limit", "40", "--json", "--out", str(tmp_path / "tp4"))
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["completed"] == 40 and s["kv_bytes_per_token"] == 327_680
    cfg = json.loads((tmp_path / "tp4" / "config.json").read_text())
    assert cfg["settings"]["tp"] == 4
    for args in (["--gpu", "h100"], ["--gpu", "h100", "--kv-mem", "60GB"], ["--gpu", "h200"]):
        r = _cli("replay", "traces/chat.jsonl", "--executor", "sim", "--model", "llama-3-70b", *args,
                 "--out", str(tmp_path / "x"))
        assert r.returncode == 2 and "--tp" in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--executor", "sim", "--tp", "0"], "--tp"),
    (["--executor", "sim", "--model", "llama-3-8b", "--tp", "3"], "--tp"),
    (["--executor", "model", "--tp", "2"], "--tp"),
    (["--executor", "sim", "--model", "llama-3-8b", "--gpu", "h100", "--kv-mem", "70GB"], "--kv-mem"),
])
def test_bad_tp_or_kv_mem_is_one_line_exit_2(tmp_path, args, needle):
    r = _cli("replay", "traces/chat.jsonl", *args, "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_tp_halves_the_decode_step_and_pools_two_gpus(tmp_path):
    """The same trace on one and two H100s: two hold more KV and run each step faster."""
    runs = {}
    for tp in (1, 2):
        rp = Replay(str(ROOT / "traces" / "chat.jsonl"),
                    ReplayConfig(executor="sim", model="llama-3-8b", gpu="h100", tp=tp, limit=30),
                    str(tmp_path / f"tp{tp}"))
        runs[tp] = (rp.num_blocks, rp.run())
    assert runs[2][0] > 2 * runs[1][0]  # weights split too: more than twice the free memory
    assert runs[2][1]["tpot_ms_p50"] < runs[1][1]["tpot_ms_p50"]


def test_sweep_varies_tp_for_the_sim_only():
    from kvbench.cli.replay import REPLAY_OPTIONS
    from kvbench.sweep.grid import expand, parse_grid

    configs = expand(parse_grid({"executor": "sim,model", "tp": "1,2", "model": "llama-3-8b"}, REPLAY_OPTIONS))
    names = sorted(c.name for c in configs)
    assert names == ["paged-model", "paged-sim-tp1", "paged-sim-tp2"]  # the model executor has no tp


def test_kv_mem_is_checked_and_num_blocks_is_not():
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h100"])
    with pytest.raises(InputError, match="--kv-mem"):
        pool_blocks(ReplayConfig(executor="sim", kv_mem="60GB"), ex, MODELS["llama-3-8b"])
    assert pool_blocks(ReplayConfig(executor="sim", num_blocks=10**7), ex, MODELS["llama-3-8b"]) == 10**7


# -- mixture of experts --------------------------------------------------------------------------
def test_moe_runs_active_experts_and_holds_all_of_them():
    """Mixtral-8x7B: 2 of 8 experts per token (12.9B parameters run), all 8 held (46.7B)."""
    m = MODELS["mixtral-8x7b"]
    assert m.num_params == 46_702_792_704
    cost = StepCost(m)
    w_attn = 4096 * 4096 * 2 + 2 * 4096 * 1024
    expert = 3 * 4096 * 14336
    one = cost.work(batch_of([], [100]))  # one token touches its 2 experts
    assert one.linear_flops == 2 * 1 * 32 * (w_attn + 2 * expert + 4096 * 8)
    assert one.linear_bytes == pytest.approx(2 * 32 * (w_attn + 2 * expert + 4096 * 8))
    many = cost.work(batch_of([], [100] * 64))  # 64 tokens touch all 8 (8 (1 - (6/8)^64))
    assert many.linear_flops == 64 * one.linear_flops
    assert many.linear_bytes == pytest.approx(2 * 32 * (w_attn + 8 * expert + 4096 * 8), rel=1e-6)
    assert cost.weight_bytes() == pytest.approx(2 * m.num_params)
    with pytest.raises(InputError, match="--tp 2"):
        make_sim(m, GPUS["h100"])  # 93 GB of weights
    make_sim(m, GPUS["h200"])


def test_moe_shapes_from_config_json(tmp_path):
    mixtral = {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
               "num_local_experts": 8, "num_experts_per_tok": 2}
    (tmp_path / "mixtral.json").write_text(json.dumps(mixtral))
    m = get_model(str(tmp_path / "mixtral.json"))
    assert (m.num_experts, m.experts_per_token, m.moe_intermediate_size) == (8, 2, 14336)
    assert m.num_params == MODELS["mixtral-8x7b"].num_params
    qwen = {"model_type": "qwen2_moe", "num_hidden_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
            "num_key_value_heads": 16, "intermediate_size": 5632, "vocab_size": 151936, "num_experts": 60,
            "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632}
    (tmp_path / "qwen.json").write_text(json.dumps(qwen))
    q = get_model(str(tmp_path / "qwen.json"))
    assert (q.num_experts, q.experts_per_token, q.moe_intermediate_size, q.shared_expert_intermediate_size) == \
        (60, 4, 1408, 5632)
    h = 2048
    per_token = 4 * 3 * h * 1408 + 3 * h * 5632 + h + h * 60  # 4 experts + shared expert (+ gate) + router
    w = StepCost(q).work(batch_of([], [10]))
    w_attn = 2048 * 2048 * 2 + 2 * 2048 * 2048
    assert w.linear_flops == 2 * 24 * (w_attn + per_token)
    bad = {**qwen, "num_experts_per_tok": 61}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(InputError, match="num_experts_per_tok"):
        get_model(str(tmp_path / "bad.json"))


# -- calibration files ---------------------------------------------------------------------------
@pytest.mark.parametrize("content, field", [
    ('{"coefficients": {"mem_bw": NaN}}', "mem_bw"),
    ('{"coefficients": {"kv_bw": Infinity}}', "kv_bw"),
    ('{"coefficients": {"attn_flops": -1}}', "attn_flops"),
    ('{"coefficients": {"matmul_flops": 0}}', "matmul_flops"),
    ('{"coefficients": {"matmul_flops": true}}', "matmul_flops"),
    ('{"coefficients": {"mem_bw": "fast"}}', "mem_bw"),
    ('{"coefficients": {"warp_speed": 1}}', "warp_speed"),
    ('{"coefficients": {}, "colour": "red"}', "colour"),
    ('{"coefficients": [1, 2]}', "coefficients"),
    ('[{"coefficients": {}}]', "list"),
    ('{"dtype": "fp64", "coefficients": {}}', "dtype"),
    ('{"kind": "linear", "decode_step_ms": -3}', "decode_step_ms"),
    ('{"coefficients": {', "cannot read"),
])
def test_bad_calibration_file_is_one_line_exit_2(tmp_path, content, field):
    cal = tmp_path / "cal.json"
    cal.write_text(content)
    r = _cli("replay", "traces/chat.jsonl", "--executor", "sim", "--calibration", str(cal), "--limit", "3",
             "--out", str(tmp_path / "x"))
    assert r.returncode == 2, r.stderr
    assert field in r.stderr and str(cal) in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_partial_calibration_overrides_only_its_coefficients(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"coefficients": {"step_overhead_s": 0.0, "kv_bw": 1e12}}))
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h100"], str(cal))
    base = CostModel.from_gpu(GPUS["h100"])
    assert ex.cost.kv_bw == 1e12 and ex.cost.step_overhead_s == 0.0
    assert ex.cost.mem_bw == base.mem_bw and ex.cost.link_bw == base.link_bw


def test_calibration_measured_elsewhere_warns(tmp_path, caplog):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"kvbench_calibration": 2, "kvbench_version": "0.0.1", "device_name": "cpu",
                               "dtype": "fp32", "model": "tiny", "model_spec": MODELS["tiny"].to_dict(),
                               "coefficients": {"mem_bw": 1e10}}))
    with caplog.at_level("WARNING"):
        ex = make_sim(MODELS["llama-3-8b"], GPUS["h200"], str(cal), kv_dtype="bf16")
    text = caplog.text
    assert "tiny" in text and "num_layers" in text  # model shape
    assert "measured on cpu" in text  # device
    assert "fp32" in text and "--kv-dtype" in text  # dtype
    assert "0.0.1" in text  # kvbench version
    assert ex.shape.bw == 4  # weights timed in the dtype they were measured in
    caplog.clear()
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"device_name": "NVIDIA H200", "dtype": "bf16", "model": "llama-3-8b",
                                "model_spec": MODELS["llama-3-8b"].to_dict(), "coefficients": {"mem_bw": 4e12}}))
    with caplog.at_level("WARNING"):
        make_sim(MODELS["llama-3-8b"], GPUS["h200"], str(same))
    assert caplog.text == ""


def test_linear_clock_is_unchanged(tmp_path):
    clock = tmp_path / "linear.json"
    clock.write_text(json.dumps({"kind": "linear", "prefill_ms_per_token": 0.5, "decode_step_ms": 20,
                                 "overhead_ms": 1}))
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h200"], str(clock), tp=2)
    assert ex.step_time(batch_of([(0, 100, True)], [10, 20])) == pytest.approx((1 + 50 + 20) / 1e3)
    assert ex.step_time(batch_of([(0, 100, True)], [])) == pytest.approx(51 / 1e3)


def test_pcie_time_splits_over_the_gpus():
    ex1 = make_sim(MODELS["llama-3-8b"], GPUS["h100"])
    ex2 = make_sim(MODELS["llama-3-8b"], GPUS["h100"], tp=2)
    b = batch_of([], [100])
    b.pcie_bytes = 10**9
    assert ex1.pcie_time(b) == pytest.approx(1e9 / (64e9 * 0.8))
    assert ex2.pcie_time(b) == pytest.approx(ex1.pcie_time(b) / 2)
    assert ex1.breakdown(b)["pcie"] == ex1.pcie_time(b)


def test_executor_interface_without_tp_is_the_single_gpu_model():
    ex = SimExecutor(MODELS["llama-3-8b"], CostModel.from_gpu(GPUS["h200"]), GPUS["h200"])
    assert ex.kv_bytes_per_token() == MODELS["llama-3-8b"].kv_bytes_per_token() == 131_072
    assert ex.device_name == "sim:h200"


# -- weight dtype, CUDA graphs, the fixed and linear terms ---------------------------------------
def test_fp8_weights_are_one_byte_on_fp8_tensor_cores():
    """--dtype fp8: layer weights one byte each at the fp8 rate; the embedding and LM head stay bf16 (as
    ModelOpt and llm-compressor checkpoints keep them), attention and KV stay bf16 (KV auto)."""
    cost = StepCost(MODELS["llama-3-8b"], 1, "fp8", "bf16")
    w = cost.work(batch_of([], [4096] * 64))
    assert w.linear_bytes == 32 * (41_943_040 + 176_160_768)  # 6.98 GB, half of bf16's
    assert w.lm_head_bytes == 2 * 525_336_576 and w.decode_bytes == 64 * 4096 * 131_072
    assert w.kv_write_bytes == 64 * 131_072 + 2 * 64 * 4096  # new K/V and bf16 embedding rows
    assert cost.weight_bytes() == 32 * (41_943_040 + 176_160_768 + 2 * 4096) + 4096 + 2 * 2 * 525_336_576
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h100"], dtype="fp8")
    assert ex.shape.dtypes == ("fp8", "bf16") and ex.kv_bytes_per_token() == 131_072
    assert ex.cost.matmul_flops == pytest.approx(1979e12 * 0.667)  # fp8 tensor cores: twice bf16's
    assert ex.cost.attn_flops == pytest.approx(989.5e12 * 0.707)  # attention computes in bf16
    bf16 = make_sim(MODELS["llama-3-8b"], GPUS["h100"])
    b = batch_of([], [1100])
    saved = bf16.breakdown(b)["linear"] - ex.breakdown(b)["linear"]
    assert saved == pytest.approx(32 * 218_103_808 / (3.35e12 * 0.831))  # a byte less per layer weight
    assert ex.default_kv_bytes() > bf16.default_kv_bytes() + 6.9e9  # the weights' half goes to the pool


def test_fp8_on_an_a100_falls_back_to_bf16_math_and_says_so(caplog):
    with caplog.at_level("WARNING"):
        ex = make_sim(MODELS["llama-3-8b"], GPUS["a100"], dtype="fp8")
    assert "no fp8 tensor cores" in caplog.text and "a100" in caplog.text
    assert ex.shape.bw == 1 and ex.cost.matmul_flops == pytest.approx(312e12 * 0.667)
    caplog.clear()
    with caplog.at_level("WARNING"):
        make_sim(MODELS["llama-3-8b"], GPUS["h100"], dtype="fp8")
    assert caplog.text == ""


def test_eager_pays_every_layers_launches_and_graphs_do_not():
    """--eager (no CUDA graphs): 32 layers x 114 us on every step of Llama-3-8B; CUDA graphs: none."""
    b = batch_of([(0, 256, True)], [2048] * 8)
    graphs = make_sim(MODELS["llama-3-8b"], GPUS["h100"]).breakdown(b)
    eager = make_sim(MODELS["llama-3-8b"], GPUS["h100"], eager=True).breakdown(b)
    assert graphs["launch"] == 0 and eager["launch"] == pytest.approx(32 * 95e-6)
    assert {k: v for k, v in eager.items() if k != "launch"} == {k: v for k, v in graphs.items() if k != "launch"}
    assert make_sim(MODELS["llama-3-70b"], GPUS["h100"], tp=4, eager=True).breakdown(b)["launch"] == \
        pytest.approx(80 * 95e-6)


def test_overhead_counts_every_scheduled_sequence():
    """Per step 1.35 ms, and 77.3 us for each sequence the step schedules: chunks and decodes alike."""
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h100"])
    assert ex.breakdown(batch_of([], [100]))["overhead"] == pytest.approx(1.35e-3 + 77.3e-6)
    assert ex.breakdown(batch_of([(0, 64, True), (0, 64, False)], [100] * 30))["overhead"] == \
        pytest.approx(1.35e-3 + 32 * 77.3e-6)


def _write(tmp_path, content) -> str:
    path = tmp_path / "cal.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_a_linear_fit_times_steps_by_its_terms_alone(tmp_path):
    """A live server's fit (kvbench calibrate --from-run): step = overhead + a prefill_tokens +
    b decode_seqs + c context_tokens + e prefill_chunks, the roofline's rates null (no roofline term),
    the terms it does not give 0 (no per-sequence overhead of the preset's; no launches even with
    --eager). Mutation: the per-chunk term dropped -> the two-chunk step is 2 e short -> fails."""
    cal = _write(tmp_path, {"kvbench_calibration": 3, "coefficients": {
        "matmul_flops": None, "attn_flops": None, "mem_bw": None, "kv_bw": None, "step_overhead_s": 0.004,
        "prefill_token_s": 2e-5, "decode_seq_s": 3e-4, "context_token_s": 1e-7, "prefill_seq_s": 1.5e-3}})
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h100"], cal, eager=True)
    b = batch_of([(100, 300, True)], [1000, 3000])
    per_token = 300 * 2e-5 + 2 * 3e-4 + 4000 * 1e-7 + 1.5e-3
    assert ex.step_time(b) == pytest.approx(0.004 + per_token, rel=1e-12)
    assert ex.breakdown(b)["per_token"] == pytest.approx(per_token)
    two = batch_of([(0, 100, False), (50, 200, True)], [])
    assert ex.step_time(two) == pytest.approx(0.004 + 300 * 2e-5 + 2 * 1.5e-3, rel=1e-12)
    assert ex.breakdown(b)["linear"] == 0 and ex.cost.mem_bw == math.inf


def test_old_calibration_files_are_still_read(tmp_path):
    """Versions 1 and 2 (written before the per-layer, per-sequence and linear terms) fitted whole steps:
    those terms are 0 under them, as under a version-3 file that does not give them (a live server's
    linear fit gives no per-sequence term). A file without a version overrides only what it gives."""
    v2 = make_sim(MODELS["llama-3-8b"], GPUS["h100"], _write(tmp_path, {
        "kvbench_calibration": 2, "coefficients": {"matmul_flops": 5e14, "attn_flops": 4e14, "mem_bw": 3e12,
                                                   "kv_bw": 2e12, "step_overhead_s": 0.003}}), eager=True)
    assert (v2.cost.seq_overhead_s, v2.cost.layer_overhead_s, v2.cost.decode_seq_s) == (0, 0, 0)
    assert v2.cost.step_overhead_s == 0.003 and v2.cost.kv_bw == 2e12
    assert v2.breakdown(batch_of([], [100] * 4))["overhead"] == 0.003
    v1 = make_sim(MODELS["llama-3-8b"], GPUS["h100"], _write(tmp_path, {
        "kvbench_calibration": 1, "coefficients": {"matmul_flops": 5e14, "mem_bw": 3e12, "step_overhead_s": 0}}))
    assert (v1.cost.attn_flops, v1.cost.kv_bw, v1.cost.seq_overhead_s) == (5e14, 3e12, 0)
    v3 = make_sim(MODELS["llama-3-8b"], GPUS["h100"], _write(tmp_path, {
        "kvbench_calibration": 3, "coefficients": {"step_overhead_s": 0.002, "decode_seq_s": 1e-4}}))
    assert (v3.cost.seq_overhead_s, v3.cost.step_overhead_s, v3.cost.decode_seq_s) == (0, 0.002, 1e-4)
    assert v3.cost.mem_bw == pytest.approx(3.35e12 * 0.831)  # rates it does not give: the preset's
    partial = make_sim(MODELS["llama-3-8b"], GPUS["h100"], _write(tmp_path, {
        "coefficients": {"seq_overhead_s": 1e-5}}))
    assert partial.cost.seq_overhead_s == 1e-5 and partial.cost.step_overhead_s == 1.35e-3


@pytest.mark.parametrize("content, field", [
    ({"kvbench_calibration": 3, "coefficients": {"seq_overhead_s": -1e-5}}, "seq_overhead_s"),
    ({"kvbench_calibration": 3, "coefficients": {"layer_overhead_s": "fast"}}, "layer_overhead_s"),
    ({"kvbench_calibration": 3, "coefficients": {"context_token_s": None}}, "context_token_s"),
    ({"kvbench_calibration": 2, "coefficients": {"mem_bw": None}}, "mem_bw"),  # null is version 3's
    ({"kvbench_calibration": 9, "coefficients": {}}, "kvbench_calibration"),
    ({"kvbench_calibration": 3, "coefficients": {"launch_s": 1e-6}}, "launch_s"),
])
def test_bad_new_calibration_terms_are_one_line_exit_2(tmp_path, content, field):
    cal = _write(tmp_path, content)
    r = _cli("replay", "traces/chat.jsonl", "--executor", "sim", "--calibration", cal, "--limit", "3",
             "--out", str(tmp_path / "x"))
    assert r.returncode == 2, r.stderr
    assert field in r.stderr and cal in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_dtype_and_eager_from_the_command_line(tmp_path):
    """--dtype fp8 and --eager reach the sim (and config.json); the model executor refuses both."""
    from kvbench.workloads import WORKLOADS, Common, generate
    from kvbench.trace.format import write_trace

    trace = tmp_path / "random.jsonl"
    write_trace(generate(WORKLOADS["random"], Common(requests=4), WORKLOADS["random"].params(
        input_len=512, output_len=16)), str(trace))
    runs = {}
    for name, args in {"bf16": [], "fp8": ["--dtype", "fp8"], "eager": ["--eager"]}.items():
        r = _cli("replay", str(trace), "--model", "llama-3.1-8b", "--gpu", "h100", "--max-concurrency", "1",
                 "--json", "--out", str(tmp_path / name), *args)
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads(r.stdout)
    assert runs["fp8"]["tpot_ms_mean"] < runs["bf16"]["tpot_ms_mean"] < runs["eager"]["tpot_ms_mean"]
    assert runs["eager"]["tpot_ms_mean"] - runs["bf16"]["tpot_ms_mean"] == pytest.approx(32 * 0.095, rel=1e-6)
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())["settings"]
    assert (cfg["dtype"], cfg["eager"]) == ("fp8", False)
    for args in (["--dtype", "fp8"], ["--eager"]):
        r = _cli("replay", str(trace), "--executor", "model", *args, "--out", str(tmp_path / "m"))
        assert r.returncode == 2 and args[0] in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _cli("replay", str(trace), "--dtype", "int4", "--out", str(tmp_path / "q"))
    assert r.returncode == 2 and "--dtype" in r.stderr
