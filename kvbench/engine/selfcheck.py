"""Selfcheck (library part): our paged model against transformers' own implementation, same weights.

Prompts run through kvbench's model by driving block tables by hand, as the engine would: a prefix
computed once and reused by a second prompt through its blocks, chunked prefill of a long prompt mixed
with decodes in the same forward, two samples sharing prompt blocks with a copy-on-write of the
partial last block, and a sequence recomputed from scratch into fresh (stale) blocks as after a
preemption. transformers then runs each final token list in one full forward; we report the largest
logit difference over every position we computed and the share of our greedy tokens that are also
transformers' argmax. ``run_engine_selfcheck`` replays requests through the real engine instead, and
``run_sliding_selfcheck`` does so for a tiny random model whose sliding-window layers alternate with
full-attention ones, on the hybrid KV manager, whose window frees blocks as the sequences grow.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvbench import kernels
from kvbench.executors.model import ModelExecutor, resolve_device
from kvbench.executors.modeling import (
    PagedAttention,
    PagedLlama,
    build_inputs,
    build_model,
    make_kv_pool,
)
from kvbench.executors.presets import ModelSpec, get_model

# Largest logit difference accepted, and the share of greedy tokens that must agree, per dtype.
# bf16 (GPU): transformers runs in bf16 too; near-ties may flip a token, so 95% must agree.
TOLERANCE = {torch.float32: (1e-3, 1.0), torch.bfloat16: (5e-2, 0.95)}


def hf_model(spec: ModelSpec, state_dict: dict, device: torch.device, dtype: torch.dtype):
    """transformers' LlamaForCausalLM (Qwen2ForCausalLM for qwen2) of the same shape, loaded with
    ``state_dict``. Mistral is built as Llama: without sliding windows the two are the same network.
    Sliding-window layers: Qwen2's ``layer_types`` for qwen2, else MinistralForCausalLM (Llama layers,
    each sliding or full by ``layer_types``); transformers masks a window as kvbench's kernels do
    (masking_utils.sliding_window_overlay: key k is seen by query q when k > q - window)."""
    import transformers

    common: dict[str, Any] = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                  intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                  head_dim=spec.head_dim, max_position_embeddings=spec.max_model_len,
                  rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
                  tie_word_embeddings=spec.tie_word_embeddings)
    sliding = "sliding" in spec.kinds
    if sliding:
        common.update(sliding_window=spec.sliding_window,
                      layer_types=["sliding_attention" if k == "sliding" else "full_attention" for k in spec.kinds])
    cfg: Any
    cls: Any
    if spec.architecture == "qwen2":
        cfg, cls = transformers.Qwen2Config(use_sliding_window=sliding, **common), transformers.Qwen2ForCausalLM
    elif sliding:
        if spec.qkv_bias:
            raise ValueError(f"{spec.name}: no transformers class has Llama layers with q/k/v biases and "
                             "sliding windows")
        cfg, cls = transformers.MinistralConfig(**common), transformers.MinistralForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(attention_bias=spec.qkv_bias, **common), transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"
    with torch.device(device):
        m: torch.nn.Module = cls(cfg)
        m = m.to(dtype)
    m.load_state_dict(state_dict, strict=True)
    return m.eval()


def _attention_backend(net: PagedLlama) -> str:
    """The attention backend our model runs (every layer's PagedAttention holds the same)."""
    attn = net.model.layers[0].self_attn
    assert isinstance(attn, PagedAttention)
    return attn.backend


@dataclass
class _Seq:
    """A hand-driven sequence: its tokens, how many have KV in the cache, its block table."""

    name: str
    tokens: list[int]
    new_tokens: int  # tokens still to generate
    chunk: int = 1 << 30  # most prefill tokens per step
    computed: int = 0
    table: list[int] = field(default_factory=list)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> our logits [vocab]
    sampled: dict[int, int] = field(default_factory=dict)  # position -> our greedy token

    @property
    def done(self) -> bool:
        return self.new_tokens == 0


class _Driver:
    """Plays the engine's part: block allocation, batching of chunks and decodes, sampling."""

    def __init__(self, net: PagedLlama, pool: torch.Tensor, block_size: int, rng: random.Random):
        self.net, self.pool, self.bs = net, pool, block_size
        self.free = list(range(pool.shape[1]))
        rng.shuffle(self.free)  # block tables point all over the pool
        self.rng = rng

    def grow(self, s: _Seq, upto: int) -> None:
        while len(s.table) * self.bs < upto:
            s.table.append(self.free.pop())

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)
        self.rng.shuffle(self.free)

    def step(self, seqs: list[_Seq]) -> None:
        """One forward over every unfinished sequence: a prefill chunk, or a decode of its last token."""
        pre: list[tuple[_Seq, int]] = []
        dec: list[tuple[_Seq, int]] = []
        for s in seqs:
            if s.done:
                continue
            n = min(s.chunk, len(s.tokens) - s.computed)
            self.grow(s, s.computed + n)
            (dec if n == 1 and s.computed > 0 else pre).append((s, n))
        inputs = build_inputs(
            self.bs, self.pool.device,
            prefill_tokens=[np.array(s.tokens[s.computed:s.computed + n]) for s, n in pre],
            prefill_starts=[s.computed for s, _ in pre], prefill_tables=[s.table for s, _ in pre],
            prefill_sample=[True] * len(pre),
            decode_tokens=[s.tokens[-1] for s, _ in dec], decode_positions=[s.computed for s, _ in dec],
            decode_tables=[s.table for s, _ in dec], logits_for_all_tokens=True)
        logits = self.net(inputs, self.pool).cpu()  # [T, vocab], rows in batch order
        row = 0
        for s, n in pre + dec:
            for i in range(n):
                s.logits[s.computed + i] = logits[row + i]
            row += n
            s.computed += n
            if s.computed == len(s.tokens):  # the chunk ended the known tokens: sample the next one
                tok = int(s.logits[s.computed - 1].argmax())
                s.sampled[s.computed - 1] = tok
                s.tokens.append(tok)
                s.new_tokens -= 1


def _scenario(drv: _Driver, vocab: int, rng: random.Random) -> list[_Seq]:
    """Runs the hand-driven scenario; returns every sequence whose logits are to be checked."""
    bs = drv.bs
    tok = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    a = _Seq("prompt", tok(3 * bs + 5), new_tokens=8)
    c = _Seq("chunked-prefill", tok(9 * bs - 2), new_tokens=4, chunk=3 * bs)
    d1 = _Seq("sample-1", tok(2 * bs + 5), new_tokens=6)
    drv.step([a, c, d1])
    # A prefix hit: B reuses A's first 3 full blocks and computes only its own suffix.
    b = _Seq("prefix-hit", a.tokens[:3 * bs] + tok(bs + 3), new_tokens=6, computed=3 * bs, table=a.table[:3])
    # Second sample of D1's prompt: shares its full blocks, copies the partial tail (copy-on-write),
    # and starts from the same first token (sampled from the shared prefill).
    d2 = _Seq("sample-2", list(d1.tokens), new_tokens=d1.new_tokens, computed=d1.computed,
              table=d1.table[:2] + [drv.free.pop()])
    kernels.copy_blocks(drv.pool, torch.tensor([[d1.table[2], d2.table[2]]], device=drv.pool.device),
                        backend=_attention_backend(drv.net))
    d2.logits = dict(d1.logits)
    live = [a, b, c, d1, d2]
    while not a.done:
        drv.step(live)
    # Preemption of A: its private blocks go back (B still holds the shared ones) and A is recomputed
    # from scratch, prompt and generated tokens together, into blocks that hold stale KV.
    drv.release(a.table[3:])
    e = _Seq("recomputed", list(a.tokens), new_tokens=3)
    live = [b, c, d1, d2, e]
    while not all(s.done for s in live):
        drv.step(live)
    return [a, b, c, d1, d2, e]


def run_selfcheck(device: str = "cpu", model: str | ModelSpec = "tiny", seed: int = 0,
                  attention: str = "auto", block_size: int = 8) -> dict:
    """Compare our paged model with transformers on the hand-driven scenario.

    -> {"ok", "max_logit_diff", "greedy_agree", "tolerance", "tokens_compared", "positions_compared",
        "per_sequence": {name: max diff}, "model", "device", "dtype", "attention"}
    """
    dev = resolve_device(device)
    spec = model if isinstance(model, ModelSpec) else get_model(model)
    net = build_model(spec, dev, seed, attention)
    dtype = next(net.parameters()).dtype
    ref = hf_model(spec, net.state_dict(), dev, dtype)
    pool = make_kv_pool(spec, 96, block_size, dev, dtype)
    rng = random.Random(seed)
    seqs = _scenario(_Driver(net, pool, block_size, rng), spec.vocab_size, rng)
    worst, agree, sampled, positions, per_seq = 0.0, 0, 0, 0, {}
    for s in seqs:
        with torch.inference_mode():
            ids = torch.tensor([s.tokens[:-1]], device=dev)  # the last sampled token was never fed
            hf = ref(input_ids=ids).logits[0].float().cpu()  # [len, vocab]
        diff = max(float((ours - hf[p]).abs().max()) for p, ours in s.logits.items())
        per_seq[s.name] = diff
        worst = max(worst, diff)
        positions += len(s.logits)
        agree += sum(int(hf[p].argmax()) == t for p, t in s.sampled.items())
        sampled += len(s.sampled)
    tol, need = TOLERANCE[dtype]
    share = agree / sampled
    return {"ok": worst <= tol and share >= need, "max_logit_diff": worst, "greedy_agree": share,
            "tolerance": tol, "tokens_compared": sampled, "positions_compared": positions,
            "per_sequence": per_seq, "model": spec.name, "device": str(dev),
            "dtype": str(dtype).replace("torch.", ""), "attention": _attention_backend(net)}


def _engine_requests(tiers: bool = False, longer_outputs: int = 1):
    """Requests that make the engine exercise every path: a shared system prompt hit from the
    prefix cache by a later arrival, n=2 parallel samples, a long prompt cut into prefill chunks,
    (with a tight pool) preemption and recompute, and a prefix that ends inside a cached block.
    ``tiers``: a long unique prompt between them evicts the cached prompts from the pool, so the later
    arrivals load them from the tiers. ``longer_outputs``: the first four generate that many times
    more tokens (a sliding-window model frees blocks as it decodes: it takes longer outputs to run
    short of them)."""
    from kvbench.trace.format import Request, Segment

    def req(i, t, segs, out, n=1):
        prompt = tuple(Segment("shared", ln, name=name) if name else Segment("unique", ln) for name, ln in segs)
        return Request(id=f"r{i}", t=t, prompt=prompt, output_len=out, n=n, index=i, line=i + 1,
                       prompt_len=sum(ln for _, ln in segs))

    k = longer_outputs
    return [
        req(0, 0.0, [("sys", 40), (None, 10)], 12 * k),
        req(1, 0.0, [("sys", 40), (None, 13)], 12 * k, n=2),
        req(2, 0.0, [("doc", 150)], 10 * k),
        req(3, 0.0, [("sys", 40), ("doc", 30), (None, 7)], 12 * k),
        req(4, 1e4, [("sys", 40), (None, 9)], 8),  # arrives after the rest: hits the cached prompt
        # radix: matches r3's blocks, then 4 tokens into its next block (copied, the rest recomputed)
        req(5, 2e4, [("sys", 40), ("doc", 28), (None, 5)], 6),
    ] + ([req(6, 5e3, [(None, 230)], 4)] if tiers else [])


def run_engine_selfcheck(device: str = "cpu", model: str = "tiny", seed: int = 0,
                         attention: str = "auto", prefix_mode: str = "hash", tiers: bool = False,
                         num_blocks: int = 34, longer_outputs: int = 1) -> dict:
    """Replay a small trace through the real engine (model executor, paged KV, prefix cache, n>1,
    chunked prefill, a pool tight enough to preempt) and compare, at every position where a token was
    sampled, the logits and their greedy choice with transformers' on the same sequence, same
    weights. ``tiers``: with a small CPU tier and a disk tier behind the pool, written back as the
    pool evicts (so blocks also move from the CPU tier to the disk tier), and loaded whenever found:
    the later arrivals' prompts come back from both tiers as real copies. A model with KV cache groups
    (sliding-window layers: run_sliding_selfcheck) runs on the hybrid KV manager, each group's tables
    in the batches; ``exercised`` then counts the table entries a window had freed (-1) that the
    forwards were handed, and the most in one step."""
    import tempfile

    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.replay import Replay
    from kvbench.executors.modeling import default_dtype
    from kvbench.memory.hybrid import NULL

    reqs = sorted(_engine_requests(tiers, longer_outputs), key=lambda r: r.t)
    tier_cfg: dict[str, Any] = {}  # ReplayConfig's tier fields
    if tiers:
        dtype = "fp32" if default_dtype(resolve_device(device)) == torch.float32 else "bf16"
        block = get_model(model).kv_bytes_per_token(dtype) * 8
        tier_cfg = {"cpu_kv_mem": str(3 * block), "disk_kv_mem": str(64 * block), "offload": "write-back",
                    "load_policy": "always"}
    cfg = ReplayConfig(executor="model", model=model, device=device, seed=seed, attention=attention,
                       block_size=8, num_blocks=num_blocks, max_batched_tokens=64, max_model_len=512,
                       prefix_mode=prefix_mode, **tier_cfg)
    freed = [0, 0]  # NULL entries handed to the forwards in all, and the most in one step

    def count_freed(_replica, _start, _end, batch, _emitted) -> None:
        n = sum(t.count(NULL) if isinstance(t, list) else sum(1 for b in t if b == NULL)
                for tables in batch.group_tables.values() for t in tables)
        freed[0] += n
        freed[1] = max(freed[1], n)

    with tempfile.TemporaryDirectory() as tmp:
        rp = Replay("<selfcheck>", cfg, tmp, requests=reqs)
        ex = rp.executor
        assert isinstance(ex, ModelExecutor)  # (executor="model")
        rp.finished = []
        ex.logits_log = {}
        rp.step_hook = count_freed
        summary = rp.run()
    ref = hf_model(ex.spec, ex.net.state_dict(), ex.device, ex.dtype)
    agree = total = 0
    worst = 0.0
    per_request = {}
    for rs in rp.finished:
        out_len = rs.req.output_len
        samples = rs.samples or []
        # a forked sample's first token came from its parent's prefill: the one with every row
        rows = {sid: ex.logits_log.get(sid, []) for sid, _ in samples}
        first = next((r[0] for r in rows.values() if len(r) == out_len), None)
        n_equal = 0
        prompt = rs.prompt
        assert prompt is not None  # (the model executor takes tokens)
        plen = len(prompt)
        for sid, toks in samples:
            # The engine feeds each sample the tokens of its own stream (kvbench.trace.tokens), so
            # transformers is fed the same sequence: its logits at every sampled position must match
            # ours, and so must the greedy choice made from them.
            ours = rows[sid] if len(rows[sid]) == out_len else [first] + rows[sid]
            seq = prompt.tolist() + toks[:-1]
            with torch.inference_mode():
                hf = ref(input_ids=torch.tensor([seq], device=ex.device)).logits[0].float().cpu().numpy()
            for i, row in enumerate(ours):
                want = hf[plen - 1 + i]
                worst = max(worst, float(np.abs(row - want).max()))
                n_equal += int(row.argmax() == want.argmax())
        per_request[rs.req.id] = {"samples": len(samples), "tokens_equal": n_equal,
                                  "tokens": out_len * len(samples)}
        agree += n_equal
        total += out_len * len(samples)
    tol, need = TOLERANCE[ex.dtype]
    share = agree / total if total else 0.0
    exercised = {"prefix_hit_tokens": int(round(summary["prefix_hit_rate"] * sum(r.prompt_len for r in reqs))),
                 "preemptions": summary["preemptions"], "parallel_samples": sum(r.n > 1 for r in reqs),
                 "cow_copies": summary["cow_copies"], "max_batched_tokens": cfg.max_batched_tokens,
                 "prefix_mode": prefix_mode, "partial_hit_tokens": summary.get("partial_hit_tokens", 0),
                 "tier_bytes_loaded": summary["bytes_loaded"], "tier_bytes_stored": summary["bytes_stored"],
                 "cpu_hit_rate": summary["hit_rate_cpu"], "disk_hit_rate": summary["hit_rate_disk"],
                 "kv_groups": rp.kv_layout.describe(), "freed_table_entries": freed[0],
                 "freed_table_entries_max_step": freed[1]}
    return {"ok": share >= need and worst <= tol and summary["completed"] == len(reqs),
            "greedy_agree": share, "max_logit_diff": worst, "tolerance": tol,
            "tokens_compared": total, "completed": summary["completed"], "exercised": exercised,
            "per_request": per_request}


# A tiny random Qwen2-style model (transformers' Qwen2 with ``layer_types``) whose sliding-window layers
# alternate with full-attention ones: two KV cache groups of two layers, the window (20 tokens: two and
# a half blocks of 8) far shorter than the selfcheck's prompts, so the hybrid KV manager frees the
# blocks that leave it. Random weights from the run's seed; no checkpoint, no hub.
SLIDING_CONFIG: dict[str, Any] = {
    "model_type": "qwen2", "vocab_size": 32000, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "use_sliding_window": True, "sliding_window": 20,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}


def run_sliding_selfcheck(device: str = "cpu", seed: int = 0, attention: str = "auto",
                          config: dict | None = None) -> dict:
    """run_engine_selfcheck on a model with sliding-window layers (``config``, a config.json's fields;
    SLIDING_CONFIG when None), read from a model folder as a user's would be: the hybrid KV manager's
    two groups (sliding and full, each its own block table), prefix hits, chunked prefill, a
    preemption and blocks freed as they leave the window, held to transformers' Qwen2 with the same
    weights. The result adds the model's ``window``; ``ok`` also needs a freed table entry."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        with open(f"{folder}/config.json", "w", encoding="utf-8") as fh:
            json.dump(config or SLIDING_CONFIG, fh)
        # 36 blocks and outputs three times as long: the decodes outgrow the pool (a preemption) even
        # though the sliding group gives a block back for each one it takes
        out = run_engine_selfcheck(device, folder, seed, attention, num_blocks=36, longer_outputs=3)
    out["window"] = (config or SLIDING_CONFIG)["sliding_window"]
    out["ok"] = out["ok"] and out["exercised"]["freed_table_entries"] > 0
    return out
