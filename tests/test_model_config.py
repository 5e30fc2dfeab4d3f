"""Model shapes read from real config.json files (kvbench/executors/hf_config.py), the presets built
from the published configs (kvbench/executors/configs/), the bad configs refused, and the sim's cost per
layer kind (sliding window, chunked-local, MLA, quantized weights).

Published figures the presets are held to:
  gpt-oss-120b / -20b   OpenAI's model card: 116.83B / 20.91B parameters (biases included; kvbench
                        leaves the 40M / 10M of biases out), checkpoints of 60.8 / 12.8 GiB (MXFP4 experts)
  gemma-3-27b           Gemma 3 technical report: 25,600M non-embedding parameters, 1,416M embedding
  llama-4-scout         Meta: 109B parameters, the vision encoder's ~0.9B included (not modelled here)
  deepseek-v3           the model card: 671B in the main model (the 14B of its multi-token-prediction
                        module, which vLLM does not load to serve, and the repository's 685B, aside)
Every other figure below is worked out by hand from the configs' fields, not from kvbench's code.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvbench.errors import InputError
from kvbench.executors.hf_config import read_hf_config
from kvbench.executors.model_config import AttnGroup
from kvbench.executors.presets import CONFIGS_DIR, GPUS, HYBRID_PRESETS, MODELS, SIM_MODELS, get_model
from kvbench.executors.sim import StepCost, make_sim
from kvbench.memory.specs import LayerKV
from kvbench.scheduler.batch import StepBatch

ROOT = Path(__file__).resolve().parents[1]
BAD = ROOT / "tests" / "data" / "models"
GiB = 2**30

# preset -> (layers by kind with their windows, KV bytes per token per layer, params, weight bytes)
SHAPES = {
    # 36 layers alternating sliding 128 / full; 8 KV heads x 64 x K,V x bf16 = 2,048 B a layer
    "gpt-oss-120b": ({("sliding", 128): 18, ("full", 0): 18}, 2048, 116_789_048_640, 65_168_599_680),
    "gpt-oss-20b": ({("sliding", 128): 12, ("full", 0): 12}, 2048, 20_907_927_360, 13_747_605_120),
    # every 6th of 62 layers global; 16 KV heads x 128 x 2 x 2 = 8,192 B a layer
    "gemma-3-27b": ({("sliding", 1024): 52, ("full", 0): 10}, 8192, 27_008_663_808, 54_017_327_616),
    # every 4th of 48 layers NoPE (global), the rest chunked-local; 8 x 128 x 2 x 2 = 4,096 B a layer
    "llama-4-scout": ({("chunked", 8192): 36, ("full", 0): 12}, 4096, 107_769_861_120, 215_539_722_240),
    # 61 MLA layers of one latent of 512 + 64 bf16 values: 1,152 B a layer
    "deepseek-v3": ({("mla", 0): 61}, 1152, 671_026_404_352, 673_150_545_584),
    # every 4th of 48 layers full attention (2 KV heads x 256: 2,048 B a layer), the rest Gated DeltaNet
    "qwen3-next-80b-a3b": ({("mamba", 0): 36, ("full", 0): 12}, 2048, 79_674_378_240, 159_348_756_480),
    # attention at layers 5, 15, 25, 35 (4 KV heads x 128: 2,048 B a layer), the rest Mamba-2
    "granite-4.0-h-tiny": ({("mamba", 0): 36, ("full", 0): 4}, 2048, 6_938_801_664, 13_877_603_328),
}


def counts(m) -> dict:
    out: dict = {}
    for kind in m.kinds:
        out[(kind, m.window(kind))] = out.get((kind, m.window(kind)), 0) + 1
    return out


def batch_of(chunks, decodes) -> StepBatch:
    b = StepBatch(block_size=16)
    for i, (start, n, last) in enumerate(chunks):
        b.prefill_seq_ids.append(i)
        b.prefill_starts.append(start)
        b.prefill_lens.append(n)
        b.prefill_last.append(last)
    for j, ctx in enumerate(decodes):
        b.decode_seq_ids.append(100 + j)
        b.decode_positions.append(ctx - 1)
    return b


def write(tmp_path, cfg, name="config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


BASE = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 4, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 4096}


# -- the presets, from their published configs ---------------------------------------------------
@pytest.mark.parametrize("name", HYBRID_PRESETS)
def test_each_preset_has_its_published_shape(name):
    kinds, layer_kv, params, weight_bytes = SHAPES[name]
    m = SIM_MODELS[name]
    assert counts(m) == kinds
    layers = m.kv_layers("bf16")
    attention = [layer for layer in layers if layer.kind != "mamba"]  # (a recurrent layer keeps no KV per token)
    assert len(layers) == m.num_layers and {layer.bytes_per_token for layer in attention} == {layer_kv}
    assert m.kv_bytes_per_token() == len(attention) * layer_kv == sum(layer.bytes_per_token for layer in layers)
    assert m.kv_bytes_per_token("fp8") * 2 == m.kv_bytes_per_token()
    assert (m.num_params, m.weight_bytes()) == (params, weight_bytes)
    assert m.name == name and m.max_model_len > max(m.sliding_window, m.attention_chunk_size)
    assert get_model(name) is m and name not in MODELS  # presets only the sim runs


def test_the_presets_match_their_published_parameter_counts_and_checkpoints():
    """Within the stated tolerance of the figures in the module docstring."""
    gb = {n: SIM_MODELS[n].weight_bytes() / GiB for n in HYBRID_PRESETS}
    assert SIM_MODELS["gpt-oss-120b"].num_params == pytest.approx(116.83e9, rel=1e-3)  # biases left out
    assert gb["gpt-oss-120b"] == pytest.approx(60.8, rel=0.01)
    assert SIM_MODELS["gpt-oss-20b"].num_params == pytest.approx(20.91e9, rel=1e-3)
    assert gb["gpt-oss-20b"] == pytest.approx(12.8, rel=0.01)
    gemma = SIM_MODELS["gemma-3-27b"]
    embedding = gemma.vocab_size * gemma.hidden_size
    assert gemma.num_params - embedding == pytest.approx(25_600e6, rel=1e-3)
    assert embedding == pytest.approx(1_416e6, rel=0.01)
    assert 0.98 * 109e9 < SIM_MODELS["llama-4-scout"].num_params < 109e9  # its vision encoder left out
    assert SIM_MODELS["deepseek-v3"].num_params == pytest.approx(671e9, rel=1e-3)
    assert SIM_MODELS["qwen3-next-80b-a3b"].num_params == pytest.approx(80e9, rel=0.01)  # its MTP layer left out
    assert SIM_MODELS["granite-4.0-h-tiny"].num_params == pytest.approx(7e9, rel=0.01)
    assert 0.66e12 < SIM_MODELS["deepseek-v3"].weight_bytes() < 0.69e12  # block fp8, bf16 embedding and norms


def test_quantized_weight_bytes_worked_out():
    """DeepSeek-V3: every projection block fp8 (1 byte, and a float32 scale per 128 x 128 block); the
    router, norms, embedding and LM head bf16. gpt-oss-120b: the experts MXFP4 (4.25 bits), the rest bf16."""
    quantized = (61 * 187_105_280 + 3 * 396_361_728  # MLA projections; 3 dense MLPs of 3 x 7168 x 18432
                 + 58 * (256 + 1) * 44_040_192)  # 58 MoE layers of 256 routed + 1 shared 3 x 7168 x 2048
    plain = 58 * 7168 * 256 + 61 * (2 * 7168 + 1536 + 512) + 7168 + 2 * 129_280 * 7168
    assert SIM_MODELS["deepseek-v3"].weight_bytes() == quantized * (1 + 4 / 128**2) + 2 * plain
    experts = 36 * 128 * 3 * 2880 * 2880
    rest = 36 * (2 * 2880 * 4096 + 2 * 2880 * 512 + 2880 * 128 + 2 * 2880) + 2880 + 2 * 201_088 * 2880
    assert SIM_MODELS["gpt-oss-120b"].weight_bytes() == experts * 4.25 / 8 + 2 * rest


def test_deepseek_v3_holds_its_mla_latent_whole_on_every_gpu():
    """61 x (512 + 64) x 2 = 70,272 bytes a token, at every --tp (vLLM keeps one MLA head per rank)."""
    m = SIM_MODELS["deepseek-v3"]
    assert m.kv_bytes_per_token() == 61 * 576 * 2 == 70_272
    for tp in (1, 2, 4, 8, 16):
        assert m.kv_layers("bf16", tp) == [LayerKV("mla", 1, 576, 2)] * 61
        assert StepCost(m, tp).kv_tok == 70_272
    ex = make_sim(m, GPUS["h200"], tp=8)
    assert ex.shape.kv_tok == 70_272 and ex.kv_bytes_per_token() == 8 * 70_272  # the pool pays every copy
    assert ex.kv_layers() == m.kv_layers("bf16", 8)
    assert make_sim(m, GPUS["h200"], tp=8, kv_dtype="fp8").kv_layers()[0] == LayerKV("mla", 1, 576, 1)
    assert m.dense_layers == (0, 1, 2) and m.shared_expert_intermediate_size == 2048
    assert not m.shared_expert_gate and m.quant.method == "fp8-block"


def test_gqa_kv_heads_split_or_replicate_over_tp():
    g = SIM_MODELS["gpt-oss-120b"]  # 8 KV heads
    assert g.kv_layers("bf16", 4)[:2] == [LayerKV("sliding", 2, 64, 2, 128), LayerKV("full", 2, 64, 2)]
    assert g.kv_layers("fp8", 16)[1] == LayerKV("full", 1, 64, 1)  # one replica a GPU
    assert StepCost(g, 4).kv_tok == 36 * 2 * 2 * 64 * 2
    with pytest.raises(InputError, match="--tp"):
        g.kv_layers("bf16", 3)


def test_gpt_oss_120b_fits_one_80gb_gpu():
    """Its experts are MXFP4: 65.2 GB of weights, not the 234 GB of a bf16 reading."""
    m = SIM_MODELS["gpt-oss-120b"]
    for gpu in ("h100", "h200"):
        ex = make_sim(m, GPUS[gpu])
        assert ex.weights_per_gpu == pytest.approx(65.17e9, rel=1e-3)
        assert ex.weights_per_gpu + ex.activations_per_gpu < 0.9 * GPUS[gpu].mem_bytes and ex.default_kv_bytes() > 5e9
    assert 2 * m.num_params > 230e9
    with pytest.raises(InputError, match="--dtype"):
        make_sim(m, GPUS["h100"], dtype="fp8")  # the checkpoint says what its weights are


# -- reading configs ----------------------------------------------------------------------------------
def test_nested_text_config_is_the_language_model():
    """Gemma 3 and Llama 4 ship multimodal configs: the language model under text_config, with the fields
    transformers fills in left out (Gemma 3's vocabulary, window pattern and tied embedding)."""
    gemma = SIM_MODELS["gemma-3-27b"]
    assert (gemma.architecture, gemma.vocab_size, gemma.max_model_len, gemma.tie_word_embeddings) == \
        ("gemma3_text", 262_208, 131_072, True)
    assert [i for i, k in enumerate(gemma.kinds) if k == "full"] == list(range(5, 62, 6))
    scout = SIM_MODELS["llama-4-scout"]
    assert [i for i, k in enumerate(scout.kinds) if k == "full"] == list(range(3, 48, 4))  # NoPE: global
    assert (scout.num_experts, scout.experts_per_token, scout.moe_intermediate_size) == (16, 1, 8192)
    assert (scout.shared_expert_intermediate_size, scout.dense_layers, scout.intermediate_size) == (8192, (), 16384)
    assert (scout.num_heads, scout.num_kv_heads, scout.head_dim, scout.vocab_size) == (40, 8, 128, 202_048)
    raw = json.loads(Path(CONFIGS_DIR, "llama-4-scout.json").read_text())
    assert raw["text_config"]["no_rope_layers"] == [] and "num_attention_heads" not in raw


def test_llama4_layer_lists_written_out_read_the_same(tmp_path):
    raw = json.loads(Path(CONFIGS_DIR, "llama-4-scout.json").read_text())
    text = raw["text_config"]
    listed = {**raw, "text_config": {**text, "no_rope_layers": [1, 1, 1, 0] * 12, "moe_layers": list(range(48))}}
    typed = {**raw, "text_config": {**text, "layer_types": [  # as transformers 5 writes it
        "full_attention" if (i + 1) % 4 == 0 else "chunked_attention" for i in range(48)]}}
    for cfg in (listed, typed):
        m = read_hf_config(write(tmp_path, cfg), name="llama-4-scout")
        assert m == SIM_MODELS["llama-4-scout"]
    maverick = {**raw, "text_config": {**text, "interleave_moe_layer_step": 2, "num_local_experts": 128}}
    m = read_hf_config(write(tmp_path, maverick))
    assert m.dense_layers == tuple(range(0, 48, 2)) and m.moe_layers == 24
    assert m.num_params == pytest.approx(400e9, rel=0.02)  # Llama 4 Maverick: 400B (vision included)


def test_the_parser_gives_what_transformers_builds():
    """The same files through transformers' config classes and models (on the meta device, no memory):
    the same layer types and the same parameter count (biases, attention sinks and DeepSeek's expert
    score bias, which kvbench leaves out, aside)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    for name in HYBRID_PRESETS:
        raw = json.loads(Path(CONFIGS_DIR, f"{name}.json").read_text())
        for key in ("quantization_config", "auto_map"):
            raw.pop(key, None)
        if "attn_temperature_tuning" in raw.get("text_config", {}):  # transformers 5 wants a bool
            raw["text_config"]["attn_temperature_tuning"] = True
        cfg = transformers.CONFIG_MAPPING[raw["model_type"]](**{k: v for k, v in raw.items() if k != "model_type"})
        text = cfg.get_text_config()
        m = SIM_MODELS[name]
        if getattr(text, "layer_types", None) is not None:
            assert [{"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
                     "linear_attention": "mamba", "mamba": "mamba", "attention": "full"}[t]
                    for t in text.layer_types] == list(m.kinds), name
        with torch.device("meta"):
            net = transformers.AutoModelForCausalLM.from_config(text)
        params = {n: p.numel() for n, p in net.named_parameters()}
        weights = sum(v for n, v in params.items() if not n.endswith(("bias", "sinks", "e_score_correction_bias")))
        extra_norms = {"gemma-3-27b": 62 * (2 * 5376 + 2 * 128),  # pre/post-MLP norms, q/k norms
                       # per recurrent layer its decay (A_log, per head), gated norm (Qwen: per value dim, Granite:
                       # the inner dims) and Granite's skip (D, per head); Qwen's q/k norms per attention layer
                       "qwen3-next-80b-a3b": 36 * (32 + 128) + 12 * 2 * 256,
                       "granite-4.0-h-tiny": 36 * (48 + 48 + 3072)}.get(name, 0)
        assert weights == m.num_params + extra_norms, name


def test_sliding_windows_follow_the_architectures_rule(tmp_path):
    def kinds(**fields):
        return read_hf_config(write(tmp_path, {**BASE, **fields})).kinds

    # Qwen2: a window that is off (longer than the model) is not read
    assert kinds(model_type="qwen2", sliding_window=131072, use_sliding_window=False, max_window_layers=28) == \
        ("full",) * 4
    assert kinds(model_type="qwen2", sliding_window=1024, use_sliding_window=True, max_window_layers=2) == \
        ("full", "full", "sliding", "sliding")
    assert kinds(model_type="mistral", sliding_window=1024) == ("sliding",) * 4  # Mistral v0.1: every layer
    assert kinds(model_type="gemma2", sliding_window=1024) == ("sliding", "full") * 2
    assert kinds(sliding_window=1024, sliding_window_pattern=4) == ("sliding",) * 3 + ("full",)
    assert kinds(model_type="mistral", sliding_window=None) == ("full",) * 4  # null: absent


def test_moe_under_its_several_names(tmp_path):
    deepseek = {**BASE, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                "n_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    m = read_hf_config(write(tmp_path, deepseek))
    assert (m.num_experts, m.dense_layers, m.shared_expert_intermediate_size) == (8, (0, 1, 3), 128)
    h = 256
    assert m.mlp_params() == 8 * 3 * h * 64 + 3 * h * 128 + h * 8  # no gate on DeepSeek's shared experts
    gpt_oss = {**BASE, "num_local_experts": 4, "experts_per_token": 2}
    assert read_hf_config(write(tmp_path, gpt_oss)).experts_per_token == 2
    qwen = {**BASE, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert read_hf_config(write(tmp_path, qwen)).dense_layers == (0, 2, 3)


@pytest.mark.parametrize("quant, kinds, per_weight", [
    ({"quant_method": "fp8", "activation_scheme": "static"}, ("attn", "mlp", "experts", "shared_experts"), 1.0),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["model.layers.*.self_attn"]},
     ("mlp", "experts", "shared_experts"), 1 + 4 / 16384),
    ({"quant_method": "mxfp4"}, ("experts",), 4.25 / 8),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "modules_to_not_convert": ["gate"]},
     ("attn", "mlp", "experts", "shared_experts"), 0.5 + 2.5 / 128),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": False}, None, 0.5 + 2 / 64),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, None, 0.5),
    ({"quant_method": "gptq", "bits": 8, "group_size": 32}, None, 1 + 3 / 32),
])
def test_quantization_methods_give_their_bytes(tmp_path, quant, kinds, per_weight):
    m = read_hf_config(write(tmp_path, {**BASE, "num_local_experts": 4, "num_experts_per_tok": 1,
                                        "quantization_config": quant}))
    assert m.quant.bytes_per_weight == per_weight
    if kinds:
        assert m.quant.kinds == kinds
    counts_ = m.param_counts()
    assert m.weight_bytes() == pytest.approx(sum(n * (per_weight if k in m.quant.kinds else 2)
                                                 for k, n in counts_.items()))


def test_a_quantization_config_outside_text_config_is_read(tmp_path):
    raw = json.loads(Path(CONFIGS_DIR, "llama-4-scout.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert read_hf_config(write(tmp_path, raw)).quant.method == "fp8"
    raw["quantization_config"] = {"quant_method": "compressed-tensors"}
    with pytest.raises(InputError, match=r"field 'quantization_config.quant_method'"):
        read_hf_config(write(tmp_path, raw))


# -- what cannot be represented is refused, naming the file and the field --------------------------
@pytest.mark.parametrize("name", sorted(p.name for p in BAD.glob("*.json")))
def test_bad_configs_are_refused_naming_the_field(name):
    path = str(BAD / name)
    field = json.loads(Path(path).read_text())["_refused_field"]
    with pytest.raises(InputError) as e:
        read_hf_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: field '{field}': ") and "\n" not in msg, msg


@pytest.mark.parametrize("fields, field, words", [
    ({"layer_types": ["full_attention"] * 3}, "layer_types", "4 layer types"),
    ({"layer_types": ["sliding_attention"] * 4}, "sliding_window", "required field missing"),
    ({"layer_types": ["mamba"] * 4}, "layer_types", "recurrent layers without the fields of their state"),
    ({"layer_types": ["mamba2"] * 4}, "layer_types", "mamba2 layer"),
    ({"sliding_window": -128}, "sliding_window", "positive integer"),
    ({"kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "sliding_window": 64},
     "sliding_window", "MLA"),
    ({"kv_lora_rank": 64, "qk_rope_head_dim": 16}, "qk_nope_head_dim", "required field missing"),
    ({"attention_chunk_size": 1024, "no_rope_layers": [1, 0]}, "no_rope_layers", "2 entries for 4 layers"),
    ({"quantization_config": {"quant_method": "awq", "bits": 3}}, "quantization_config.bits", "not modelled"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     "quantization_config.weight_block_size", "two positive integers"),
    ({"quantization_config": "fp8"}, "quantization_config", "JSON object"),
    ({"hybrid_override_pattern": "M-M"}, "hybrid_override_pattern", "4 characters of M \\(Mamba\\)"),
    ({"hybrid_override_pattern": "M-M*"}, "mamba_num_heads", "required field missing"),
    ({"text_config": [1]}, "text_config", "JSON object"),
])
def test_more_bad_fields_are_refused(tmp_path, fields, field, words):
    path = write(tmp_path, {**BASE, **fields})
    with pytest.raises(InputError, match=words) as e:
        read_hf_config(path)
    assert f"{path}: field '{field}': " in str(e.value)


def test_the_cli_refuses_a_bad_config_in_one_line_and_replays_a_preset(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVBENCH_NO_CACHE": "1"}
    bad = str(BAD / "linear-attention.json")
    r = subprocess.run([sys.executable, "-m", "kvbench", "replay", "traces/chat.jsonl", "--model", bad, "--limit", "2",
                        "--out", str(tmp_path / "bad")], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 2 and bad in r.stderr and "linear_num_key_heads" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvbench", "replay", "traces/chat.jsonl", "--model", "gpt-oss-120b",
                        "--gpu", "h100", "--limit", "3", "--json", "--out", str(tmp_path / "ok")],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["completed"] == 3


def test_the_model_executor_refuses_what_its_forward_would_run_as_another_model():
    pytest.importorskip("torch")
    from kvbench.executors.modeling import check_runnable

    for name in HYBRID_PRESETS:
        with pytest.raises(InputError, match="--model") as e:
            check_runnable(SIM_MODELS[name])
        assert "--executor sim" in str(e.value)
    check_runnable(MODELS["llama-3-8b"])
    sliding = replace(MODELS["tiny"], layer_kinds=("sliding", "full"), sliding_window=64)
    check_runnable(sliding)  # a Llama-family model with sliding layers runs (tests/test_sliding_window.py)
    with pytest.raises(InputError, match="1 sliding 64 \\+ 1 full"):
        check_runnable(replace(sliding, architecture="gemma2"))


# -- the sim's cost per layer kind -----------------------------------------------------------------
def brute(kind: str, window: int, start: int, n: int) -> tuple[int, int]:
    """Keys each query of a chunk sees, summed, and the distinct keys the chunk reads, one by one."""
    seen, keys = 0, set()
    for q in range(start, start + n):
        first = max(0, q - window + 1) if kind == "sliding" else q // window * window if kind == "chunked" else 0
        seen += q + 1 - first
        keys.update(range(first, q + 1))
    return seen, len(keys)


@pytest.mark.parametrize("kind, window", [("full", 0), ("sliding", 5), ("sliding", 128), ("chunked", 4),
                                          ("chunked", 96)])
def test_each_kinds_keys_match_a_query_by_query_count(kind, window):
    g = AttnGroup(kind, window, kv=1, decode_pair=1.0, prefill_pair=1.0)
    for start in (0, 1, 3, 4, 5, 95, 96, 127, 128, 129, 300):
        for n in (1, 2, 4, 5, 7, 96, 129, 300):
            assert g.prefill(start, n) == brute(kind, window, start, n), (start, n)
    import numpy as np

    contexts = np.array([1, 2, 4, 5, 6, 96, 97, 128, 129, 1000])
    assert g.decode_keys(contexts, int(contexts.sum())) == sum(brute(kind, window, c - 1, 1)[0] for c in contexts)


def test_decode_attention_on_a_sliding_window_stops_growing_past_the_window():
    """Llama-3-8B with every layer sliding over 4,096 tokens: a decode's attention reads min(context, 4096)
    keys, so its time is flat past the window; gpt-oss-120b's grows with its full layers only."""
    ex = make_sim(replace(MODELS["llama-3-8b"], layer_kinds=("sliding",) * 32, sliding_window=4096), GPUS["h200"])
    t = {c: ex.breakdown(batch_of([], [c] * 64))["decode"] for c in (1024, 4096, 8192, 32768)}
    assert t[1024] < t[4096] == t[8192] == t[32768]
    assert ex.work(batch_of([], [32768] * 64)).decode_bytes == 64 * 4096 * 131_072
    g = make_sim(SIM_MODELS["gpt-oss-120b"], GPUS["h200"])
    lo, hi = g.work(batch_of([], [1024] * 64)), g.work(batch_of([], [4096] * 64))
    assert hi.decode_bytes - lo.decode_bytes == 64 * 3072 * 18 * 2048  # the 18 full layers' keys
    assert lo.decode_bytes == 64 * (128 + 1024) * 18 * 2048
    assert hi.decode_flops == 64 * (128 + 4096) * 4.0 * 18 * 64 * 64


def test_chunked_layers_read_the_current_chunk():
    """Llama 4 Scout at --tp 8 (5 query heads, one KV head a GPU): a decode at position 8,192 + 99 reads
    100 keys in each of 36 chunked layers and 8,292 in each of 12 full ones; a chunk of 1,000 prefilled
    from 8,000 crosses into the next chunk (its first queries still read from 0), one from 8,292 reads
    from 8,192."""
    cost = StepCost(SIM_MODELS["llama-4-scout"], tp=8)
    kv = 2 * 1 * 128 * 2  # a layer's K and V on one GPU
    w = cost.work(batch_of([], [8192 + 100]))
    assert w.decode_bytes == (36 * 100 + 12 * 8292) * kv
    assert w.decode_flops == (36 * 100 + 12 * 8292) * 4.0 * 5 * 128
    pre = cost.work(batch_of([(8000, 1000, True)], [])).prefill[0]
    seen = sum(range(8001, 8193)) + sum(range(1, 809))  # queries 8000..8191, then 8192..8999
    assert pre == (4.0 * 5 * 128 * (36 * seen + 12 * (1000 * 8000 + 1000 * 1001 / 2)), kv * (36 * 9000 + 12 * 9000))
    pre = cost.work(batch_of([(8292, 1000, True)], [])).prefill[0]
    seen = sum(range(101, 1101))
    assert pre == (4.0 * 5 * 128 * (36 * seen + 12 * (1000 * 8292 + 1000 * 1001 / 2)), kv * (36 * 1100 + 12 * 9292))


def test_mla_attention_absorbed_in_decode_and_decompressed_in_prefill():
    """DeepSeek-V3 at --tp 8 (16 query heads a GPU), r = 512, rope 64, nope 128, v 128, over 61 layers:
    decode 2 x 16 x (2 x 512 + 64) = 34,816 FLOPs a pair a layer; prefill 2 x 16 x (128 + 64 + 128) =
    10,240, after decompressing each cached token (2 x 512 x 16 x 256 = 4,194,304); the latent read once."""
    cost = StepCost(SIM_MODELS["deepseek-v3"], tp=8)
    dec = cost.work(batch_of([], [4096] * 64))
    assert (dec.decode_flops, dec.decode_bytes) == (61 * 34_816 * 64 * 4096, 70_272 * 64 * 4096)
    pre = cost.work(batch_of([(1024, 512, True)], [])).prefill[0]
    assert pre == (61 * (10_240 * 512 * (1024 + 513 / 2) + 4_194_304 * 1024), 70_272 * 1536)
    # the projections one GPU holds: q_a and kv_a whole, q_b, kv_b and o a head's share
    assert cost.w_attn == 7168 * 1536 + 1536 * 16 * 192 + 7168 * 576 + 512 * 16 * 256 + 16 * 128 * 7168
    one = cost.work(batch_of([], [100]))
    per_token = 61 * cost.w_attn + 3 * 3 * 7168 * 18432 / 8 + 58 * ((8 + 1) * 3 * 7168 * 2048 / 8 + 7168 * 256)
    assert one.linear_flops == pytest.approx(2 * per_token, rel=1e-12)


def test_quantized_weights_are_read_at_their_bytes_and_multiplied_at_their_rate():
    """gpt-oss-120b decoding one token on one H200: every layer's attention (bf16) and router (bf16),
    its 4 experts' MXFP4 bytes, at the bf16 rate; DeepSeek-V3's block fp8 at the fp8 rate."""
    ex = make_sim(SIM_MODELS["gpt-oss-120b"], GPUS["h200"])
    w = ex.work(batch_of([], [100]))
    attn = 2880 * 4096 * 2 + 2 * 2880 * 512
    assert w.linear_bytes == pytest.approx(36 * (2 * attn + 4 * 3 * 2880 * 2880 * 4.25 / 8 + 2 * 2880 * 128))
    assert ex.cost.matmul_flops == pytest.approx(989.5e12 * 0.667)
    assert make_sim(SIM_MODELS["deepseek-v3"], GPUS["h200"], tp=8).cost.matmul_flops == pytest.approx(1979e12 * 0.667)
    # 64 tokens touch nearly all 128 experts: the bytes read approach the held weights' layers
    many = ex.work(batch_of([], [100] * 64))
    assert many.linear_bytes == pytest.approx(ex.shape.layer_bytes(128 * (1 - (1 - 4 / 128) ** 64)))


def test_full_attention_models_keep_one_full_group():
    for name in ("tiny", "llama-3-8b", "llama-3-70b", "qwen2.5-7b", "mistral-7b", "mixtral-8x7b", "qwen3-30b-a3b"):
        m = MODELS[name]
        assert set(m.kinds) == {"full"} and m.quant is None and m.dense_layers == ()
        assert m.kv_bytes_per_token() == m.num_layers * m.num_kv_heads * m.head_dim * 2 * 2
        assert [g.kind for g in StepCost(m).groups] == ["full"]


def test_the_sequence_a_pool_must_hold_counts_windows_once():
    """vLLM's check: a sliding layer keeps window - 1 + a step's tokens, a chunked one chunk + them."""
    scout = StepCost(SIM_MODELS["llama-4-scout"], tp=8)
    assert scout.sequence_kv_bytes(1_000_000, 8192) == 512 * (12 * 1_000_000 + 36 * (8192 + 8192))
    gpt = StepCost(SIM_MODELS["gpt-oss-120b"])
    assert gpt.sequence_kv_bytes(100, 8192) == 100 * 36 * 2048
    assert gpt.sequence_kv_bytes(131072, 8192) == 2048 * 18 * (131072 + 127 + 8192)
