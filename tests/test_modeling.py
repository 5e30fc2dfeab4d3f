"""Our paged model against transformers on CPU float32: the selfcheck scenario (prefix hits, chunked
prefill, copy-on-write samples, recompute), weights loaded from a save_pretrained folder, and the
ModelExecutor driven through StepBatch."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvbench.engine.selfcheck import hf_model, run_selfcheck
from kvbench.executors.model import ModelExecutor
from kvbench.executors.modeling import build_inputs, build_model, make_kv_pool
from kvbench.executors.presets import MODELS, ModelSpec
from kvbench.scheduler.batch import StepBatch

QWEN2_TINY = ModelSpec("tiny-qwen2", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                       intermediate_size=256, vocab_size=1000, max_model_len=4096, rope_theta=1e6,
                       rms_norm_eps=1e-6, qkv_bias=True, architecture="qwen2")
# GQA 8:1 with tied embeddings: the other corners of the architecture.
LLAMA_TIED = ModelSpec("tiny-tied", num_layers=1, hidden_size=128, num_heads=8, num_kv_heads=1, head_dim=16,
                       intermediate_size=200, vocab_size=500, max_model_len=4096, rope_theta=5e4,
                       tie_word_embeddings=True)


@pytest.mark.parametrize("model", ["tiny", QWEN2_TINY, LLAMA_TIED], ids=["tiny", "qwen2", "tied-gqa8"])
def test_selfcheck_matches_transformers(model):
    r = run_selfcheck(device="cpu", model=model, seed=1)
    assert r["max_logit_diff"] < 1e-3, r
    assert r["greedy_agree"] == 1.0 and r["tokens_compared"] >= 30 and r["ok"]
    assert set(r["per_sequence"]) == {"prompt", "prefix-hit", "chunked-prefill", "sample-1", "sample-2",
                                      "recomputed"}


def test_selfcheck_detects_a_wrong_model():
    """The comparison can fail: a model with another rope theta than transformers' is caught."""
    net = build_model("tiny", "cpu", seed=0)
    other = hf_model(replace(net.spec, rope_theta=500.0), net.state_dict(), torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 32000, (1, 40), generator=torch.Generator().manual_seed(0))
    inputs = build_inputs(8, "cpu", prefill_tokens=[ids[0].numpy()], prefill_starts=[0],
                          prefill_tables=[list(range(5))], prefill_sample=[True], logits_for_all_tokens=True)
    ours = net(inputs, make_kv_pool(net.spec, 5, 8, "cpu", torch.float32))
    with torch.inference_mode():
        assert float((ours - other(input_ids=ids).logits[0]).abs().max()) > 1e-3


def test_loads_weights_saved_by_transformers(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, rope_theta=2500.0, rms_norm_eps=1e-5)
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    net = build_model(str(tmp_path), "cpu")
    assert net.spec.rope_theta == 2500.0  # read from transformers 5's rope_parameters too
    ids = torch.randint(0, 300, (1, 23), generator=torch.Generator().manual_seed(1))
    inputs = build_inputs(4, "cpu", prefill_tokens=[ids[0].numpy()], prefill_starts=[0],
                          prefill_tables=[[5, 1, 4, 0, 2, 3]], prefill_sample=[True], logits_for_all_tokens=True)
    ours = net(inputs, make_kv_pool(net.spec, 6, 4, "cpu", torch.float32))
    with torch.inference_mode():
        ref = hf(input_ids=ids).logits[0]
    assert float((ours - ref).abs().max()) < 1e-4


def _greedy_reference(net, tokens: list[int], n: int) -> list[int]:
    ref = hf_model(net.spec, net.state_dict(), torch.device("cpu"), torch.float32)
    out = list(tokens)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(ref(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(tokens):]


def _run_executor(ex: ModelExecutor, prompt: list[int], block_size: int, tables: dict, n_new: int,
                  copies=()) -> tuple[list[int], list]:
    """Prefill in two chunks, then decode two sequences (seq 1 a copy-on-write twin of seq 0)."""
    half = len(prompt) // 2
    results = []
    first = StepBatch(block_size, prefill_seq_ids=[0], prefill_starts=[0], prefill_lens=[half],
                      prefill_last=[False], prefill_tokens=[np.array(prompt[:half], np.int32)],
                      block_tables=tables)
    assert ex.execute(first).sampled == {}
    second = StepBatch(block_size, prefill_seq_ids=[0], prefill_starts=[half], prefill_lens=[len(prompt) - half],
                       prefill_last=[True], prefill_tokens=[np.array(prompt[half:], np.int32)], block_tables=tables)
    r = ex.execute(second)
    assert r.duration_s > 0
    out = [r.sampled[0]]
    for i in range(n_new - 1):
        pos = len(prompt) + i
        batch = StepBatch(block_size, decode_seq_ids=[0, 1], decode_positions=[pos, pos],
                          decode_tokens=[out[-1], out[-1]], block_tables=tables, copies=list(copies) if i == 0 else [])
        r = ex.execute(batch)
        assert r.sampled[0] == r.sampled[1]  # the twin sees the same KV through its copied tail block
        results.append(r)
        out.append(r.sampled[0])
    return out, results


def test_model_executor_greedy_tokens_equal_transformers():
    ex = ModelExecutor("tiny", device="cpu", seed=2, attention="torch", collect_attention=True)
    ex.bind_pool(num_blocks=32, block_size=4)
    prompt = list(np.random.default_rng(0).integers(0, 32000, 14))
    tables = {0: [9, 3, 17, 0, 25, 6], 1: [9, 3, 17, 12, 30, 7]}  # seq 1 shares 3 blocks, copies the 4th
    got, steps = _run_executor(ex, prompt, 4, tables, 6, copies=[(0, 12)])
    assert got == _greedy_reference(ex.net, prompt, 6)
    # Attention statistics: one weight per cached position; each of the 4 heads contributes mass 1.
    att = steps[-1].attention
    assert set(att) == {0, 1} and att[0].shape == (len(prompt) + 5,)
    np.testing.assert_allclose(att[0].sum(), ex.spec.num_heads, rtol=1e-5)
    np.testing.assert_allclose(att[0], att[1], rtol=1e-5)
    by_group = ex.decode_attention_by_group([0])[0]  # [L, Hkv, ctx]
    assert by_group.shape == (2, 2, len(prompt) + 5)
    np.testing.assert_allclose(by_group.sum(1).mean(0), att[0], rtol=1e-5)


def test_model_executor_slab_view_gives_the_same_tokens():
    """A slab batch (one block per sequence, block_size = slab length) over the same pool memory."""
    ex = ModelExecutor("tiny", device="cpu", seed=2, attention="torch")
    ex.bind_pool(num_blocks=32, block_size=4)
    prompt = list(np.random.default_rng(0).integers(0, 32000, 14))
    got, _ = _run_executor(ex, prompt, 32, {0: [2], 1: [1]}, 6, copies=[(2, 1)])
    assert got == _greedy_reference(ex.net, prompt, 6)


def test_every_preset_shape_builds():
    """Preset shapes are coherent with the model (checked on a 1-layer, small-vocab version of each)."""
    for name, spec in MODELS.items():
        small = replace(spec, num_layers=1, vocab_size=64, hidden_size=spec.num_heads * 8, head_dim=8,
                        intermediate_size=16)
        net = build_model(small, "cpu")
        assert net.model.layers[0].self_attn.k_proj.out_features == spec.num_kv_heads * 8, name


WIDE = ModelSpec("wide", num_layers=6, hidden_size=1024, num_heads=8, num_kv_heads=2, head_dim=128,
                 intermediate_size=2752, vocab_size=32000, max_model_len=32768)


@pytest.mark.parametrize("model", ["tiny", WIDE], ids=["tiny", "wide"])
def test_random_init_has_local_and_retrieval_heads(model):
    """The random initialisation's attention (init_random), in every layer of a narrow and a wider,
    deeper model: local heads keep their weight on the last few dozen tokens; retrieval heads attend
    to the query's own token, and split with an earlier copy of it when the context has one (660
    tokens back here, within RETRIEVAL_SPAN) — on a random prompt, the same for every seed."""
    from kvbench.memory import PagedKV, SeqKV

    n, bs, src = 700, 16, 40
    ctx = np.random.default_rng(5).integers(0, 32000, n).astype(np.int32)
    fresh = next(t for t in range(32000) if t not in set(ctx.tolist()))
    for seed in (0, 1):
        ex = ModelExecutor(model, "cpu", seed=seed, attention="torch", collect_attention=True)
        layers, hkv = ex.spec.num_layers, ex.spec.num_kv_heads
        group = ex.spec.num_heads // hkv
        ex.bind_pool(64, bs)
        for token, copy_at in ((int(ctx[src]), src), (fresh, None)):
            kv = PagedKV(64, bs, prefix_cache=False)
            s = SeqKV()
            kv.allocate(s, n + 1)
            table = {1: list(s.table)}
            ex.execute(StepBatch(block_size=bs, prefill_seq_ids=[1], prefill_starts=[0], prefill_lens=[n],
                                 prefill_last=[True], prefill_tokens=[ctx], block_tables=table))
            ex.execute(StepBatch(block_size=bs, decode_seq_ids=[1], decode_positions=[n], decode_tokens=[token],
                                 block_tables=table))
            w = ex.decode_attention_by_group([1])[1] / group  # [L, Hkv, n + 1]
            for layer in range(layers):
                for h in range(hkv):
                    head = w[layer, h]
                    if (h + layer) % 2 == 0:  # local
                        assert head[-64:].sum() > 0.9, (layer, h)
                    elif copy_at is None:  # retrieval, nothing to re-read: the query's own token
                        assert head[-1] > 0.9, (layer, h)
                    else:  # retrieval: itself and the copy, nothing else
                        assert head[copy_at] > 0.3 and head[-1] > 0.3 and head[copy_at] + head[-1] > 0.95, (layer, h)
