"""Triton kernels against their torch references: float32 at tiny shapes (exact), then bf16 and fp16 at
production shapes (head dim 128, 64-wide tiles, the planned split-KV and the single-split path).

Without a GPU the kernels run in Triton's interpreter: TRITON_INTERPRET must be set before any kernel
module is imported (triton.jit picks interpreter or compiler when it decorates), hence the top lines.
The interpreter has no bfloat16 arithmetic (it holds bf16 as raw uint16 and its tl.dot multiplies
those integers), so bf16 tests widen tl.dot's operands to float32 first (``bf16_dot``): what a tensor
core does too (exact bf16 products, float32 accumulation). Compilation for real GPUs is checked in
tests/test_kernel_compile.py.
"""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from kvbench.kernels import cache_ops, paged_attention, tuning  # noqa: E402
from kvbench.kernels import reference as ref  # noqa: E402

from kvbench import kernels  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIM = 16


def _paged(ctx_lens: list[int], block_size: int, hkv: int, gen: torch.Generator, spare: int = 3,
           head_dim: int = HEAD_DIM, dtype: torch.dtype = torch.float32):
    """Random K/V in a pool whose blocks are handed out shuffled.

    -> k_cache, v_cache [NB, BS, Hkv, D], block_tables int32 [S, MB] (padding entries -1)
    """
    nblk = [(n + block_size - 1) // block_size for n in ctx_lens]
    total = sum(nblk) + spare
    perm = torch.randperm(total, generator=gen).tolist()
    tables = torch.full((len(ctx_lens), max(nblk)), -1, dtype=torch.int32)
    for s, n in enumerate(nblk):
        tables[s, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    shape = (total, block_size, hkv, head_dim)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    return k.to(DEV, dtype), v.to(DEV, dtype), tables.to(DEV)


def _kept(ctx_lens: list[int], gen: torch.Generator) -> torch.Tensor:
    """Random kept mask, always keeping each sequence's last position (the token being decoded)."""
    width = max(ctx_lens)
    kept = torch.rand(len(ctx_lens), width, generator=gen) > 0.3
    for s, n in enumerate(ctx_lens):
        kept[s, n - 1] = True
    return kept.to(DEV)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_write_kv_matches_reference(block_size):
    gen = torch.Generator().manual_seed(block_size)
    hkv, nb, t = 2, 12, 9
    base = torch.randn(nb, block_size, hkv, HEAD_DIM, generator=gen)
    slots = torch.randperm(nb * block_size, generator=gen)[:t]
    slots[3] = -1  # padding token: written nowhere
    k = torch.randn(t, hkv, HEAD_DIM, generator=gen)
    v = torch.randn(t, hkv, HEAD_DIM, generator=gen)
    got_k, got_v = base.clone().to(DEV), base.clone().to(DEV)
    cache_ops.write_kv(got_k, got_v, k.to(DEV), v.to(DEV), slots.to(DEV))
    exp_k, exp_v = base.clone(), base.clone()
    ref.write_kv_ref(exp_k, exp_v, k, v, slots)
    torch.testing.assert_close(got_k.cpu(), exp_k, rtol=0, atol=0)
    torch.testing.assert_close(got_v.cpu(), exp_v, rtol=0, atol=0)
    # The reference itself: the slot of token 0 holds k[0], untouched slots keep their values.
    s0 = int(slots[0])
    torch.testing.assert_close(exp_k.view(-1, hkv, HEAD_DIM)[s0], k[0])
    untouched = sorted(set(range(nb * block_size)) - set(slots.tolist()))
    torch.testing.assert_close(exp_k.view(-1, hkv, HEAD_DIM)[untouched], base.view(-1, hkv, HEAD_DIM)[untouched])


def test_copy_blocks_matches_reference():
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(4, 7, 5, 2, HEAD_DIM, generator=gen)  # [layers*2, NB, BS, Hkv, D]
    pairs = torch.tensor([[0, 3], [5, 1], [2, 6]], dtype=torch.int64)
    got = pool.clone().to(DEV)
    cache_ops.copy_blocks(got, pairs.to(DEV))
    exp = pool.clone()
    ref.copy_blocks_ref(exp, pairs)
    torch.testing.assert_close(got.cpu(), exp, rtol=0, atol=0)
    assert torch.equal(exp[:, 3], pool[:, 0]) and torch.equal(exp[:, 4], pool[:, 4])


def _decode_case(block_size: int, group: int, num_splits: int, with_kept: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hkv = 2 if group < 8 else 1
    ctx_lens = [1, block_size * 2 + 3, 37, 5 * block_size]  # partial tails, a 1-token sequence
    k_cache, v_cache, tables = _paged(ctx_lens, block_size, hkv, gen)
    q = torch.randn(len(ctx_lens), hkv * group, HEAD_DIM, generator=gen).to(DEV)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    kept = _kept(ctx_lens, gen) if with_kept else None
    scale = HEAD_DIM ** -0.5
    out, lse = paged_attention.decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, max(ctx_lens),
                                                num_splits=num_splits, kept=kept, block_n=16)
    exp_out, exp_lse = ref.decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, scale, kept)
    torch.testing.assert_close(out, exp_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, exp_lse, rtol=1e-4, atol=1e-4)
    return q, k_cache, tables, seq_lens, exp_lse, kept, scale, ctx_lens


@pytest.mark.parametrize("block_size,group,num_splits", [
    (1, 1, 3), (4, 4, 1), (8, 8, 4), (16, 4, 2), (32, 1, 5), (16, 8, 7),
])
def test_decode_matches_reference(block_size, group, num_splits):
    _decode_case(block_size, group, num_splits, with_kept=False, seed=block_size * 10 + group)


def test_decode_honours_kept_mask_and_weights_second_pass():
    q, k_cache, tables, seq_lens, lse, kept, scale, ctx_lens = _decode_case(8, 4, 3, True, seed=7)
    got = paged_attention.attention_weights(q, k_cache, tables, seq_lens, lse, scale, max(ctx_lens), kept,
                                            block_n=16)
    exp = ref.attention_weights_ref(q, k_cache, tables, seq_lens, lse, scale, max(ctx_lens), kept)
    torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)
    # Every head's probabilities sum to 1 over kept positions: per KV group that is the group size.
    torch.testing.assert_close(exp.sum(-1), torch.full_like(exp.sum(-1), q.shape[1] // k_cache.shape[2]))
    assert float(exp[~kept[:, None, :].expand_as(exp)].abs().max()) == 0.0


def test_reference_decode_equals_dense_softmax():
    """The reference against plain softmax over contiguous K/V: the references are not just self-consistent."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = _paged([11], 4, 2, gen)
    q = torch.randn(1, 4, HEAD_DIM, generator=gen).to(DEV)
    slots = ref.gather_slots(tables[0], 11, 4)
    k = k_cache.view(-1, 2, HEAD_DIM)[slots].repeat_interleave(2, dim=1)  # [11, Hq, D]
    v = v_cache.view(-1, 2, HEAD_DIM)[slots].repeat_interleave(2, dim=1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q[0], k) * HEAD_DIM ** -0.5, dim=-1)
    out, _ = ref.decode_attention_ref(q, k_cache, v_cache, tables, torch.tensor([11], device=DEV),
                                      HEAD_DIM ** -0.5)
    torch.testing.assert_close(out[0], torch.einsum("hn,nhd->hd", p, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size,group", [(1, 4), (4, 1), (8, 8), (16, 4), (32, 1)])
def test_prefill_with_cached_prefix_matches_reference(block_size, group):
    gen = torch.Generator().manual_seed(100 + block_size + group)
    hkv = 2 if group < 8 else 1
    starts = [0, 2 * block_size, 13, 3]  # cached tokens before each chunk
    lens = [9, block_size + 5, 1, 20]
    ctx_lens = [s + n for s, n in zip(starts, lens)]
    k_cache, v_cache, tables = _paged(ctx_lens, block_size, hkv, gen)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = torch.randn(sum(lens), hkv * group, HEAD_DIM, generator=gen).to(DEV)
    st = torch.tensor(starts, dtype=torch.int32, device=DEV)
    scale = HEAD_DIM ** -0.5
    got = paged_attention.prefill_attention(q, k_cache, v_cache, tables, cu, st, scale, max(lens),
                                            block_m=16, block_n=16)
    exp = ref.prefill_attention_ref(q, k_cache, v_cache, tables, cu, st, scale)
    torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    # The last token of each chunk sees the whole context: it equals a decode at that length.
    last = cu[1:].long() - 1
    dec, _ = ref.decode_attention_ref(q[last], k_cache, v_cache, tables,
                                      torch.tensor(ctx_lens, dtype=torch.int32, device=DEV), scale)
    torch.testing.assert_close(exp[last], dec, rtol=1e-5, atol=1e-5)


def test_prefill_honours_kept_mask():
    gen = torch.Generator().manual_seed(5)
    starts, lens = [6, 0], [5, 7]
    ctx_lens = [s + n for s, n in zip(starts, lens)]
    k_cache, v_cache, tables = _paged(ctx_lens, 4, 2, gen)
    kept = _kept(ctx_lens, gen)
    for s, (st, n) in enumerate(zip(starts, lens)):  # a query always sees itself
        kept[s, st:st + n] = True
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEV)
    q = torch.randn(12, 4, HEAD_DIM, generator=gen).to(DEV)
    st = torch.tensor(starts, dtype=torch.int32, device=DEV)
    got = paged_attention.prefill_attention(q, k_cache, v_cache, tables, cu, st, 0.25, 7, kept,
                                            block_m=16, block_n=16)
    exp = ref.prefill_attention_ref(q, k_cache, v_cache, tables, cu, st, 0.25, kept)
    torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(exp, ref.prefill_attention_ref(q, k_cache, v_cache, tables, cu, st, 0.25))


def test_slab_table_with_huge_block_equals_paged():
    """One block per sequence (slab) and 4-token blocks hold the same tokens: same attention output."""
    gen = torch.Generator().manual_seed(9)
    ctx_lens, slab = [70, 33], 96
    k_p, v_p, tables_p = _paged(ctx_lens, 4, 2, gen)
    k_s = torch.zeros(2, slab, 2, HEAD_DIM, device=DEV)
    v_s = torch.zeros_like(k_s)
    for s, n in enumerate(ctx_lens):
        slots = ref.gather_slots(tables_p[s], n, 4)
        k_s[1 - s, :n] = k_p.view(-1, 2, HEAD_DIM)[slots]  # slabs in swapped order
        v_s[1 - s, :n] = v_p.view(-1, 2, HEAD_DIM)[slots]
    tables_s = torch.tensor([[1], [0]], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 8, HEAD_DIM, generator=gen).to(DEV)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    paged, _ = paged_attention.decode_attention(q, k_p, v_p, tables_p, lens, 0.25, 70, num_splits=2, block_n=16)
    slab_out, _ = paged_attention.decode_attention(q, k_s, v_s, tables_s, lens, 0.25, 70, num_splits=2, block_n=16)
    torch.testing.assert_close(paged, slab_out, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Sliding windows: a query at p sees p - W + 1 .. p; blocks before the window are never read


def _free_before_window(k_cache, v_cache, tables, firsts: list[int], block_size: int) -> list[tuple[int, int, int]]:
    """What the hybrid KV manager leaves of a sequence whose queries see from position ``firsts[s]`` on:
    every block wholly before it freed (table entry -1 in odd sequences) and its K/V poisoned with NaN
    (in even ones the entry still points at the poisoned block), so a kernel that reads one either
    dereferences -1 or turns its output NaN. -> the freed (sequence, table column, block)."""
    freed = []
    for s, first in enumerate(firsts):
        for j in range(first // block_size):
            b = int(tables[s, j])
            k_cache[b] = float("nan")
            v_cache[b] = float("nan")
            if s % 2:
                tables[s, j] = -1
            freed.append((s, j, b))
    return freed


@pytest.fixture
def reads(monkeypatch):
    """Every address the interpreter loads from (masked-off lanes excluded), as one list of arrays."""
    if DEV == "cuda":
        pytest.skip("loads are watched in Triton's interpreter")
    from triton.runtime import interpreter

    seen: list[np.ndarray] = []
    real = interpreter.InterpreterBuilder.create_masked_load

    def spy(self, ptrs, mask, other, cache_policy, is_volatile):
        addr = np.asarray(ptrs.data)
        on = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        seen.append(addr[on].astype(np.uint64))
        return real(self, ptrs, mask, other, cache_policy, is_volatile)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", spy)
    return seen


def _assert_never_read(seen: list[np.ndarray], freed, k_cache, v_cache, tables) -> None:
    """No load touched a freed block's table entry or any byte of its K or V."""
    addr = np.concatenate(seen) if seen else np.zeros(0, np.uint64)
    assert addr.size
    entry = tables.element_size()
    block = k_cache[0].numel() * k_cache.element_size()
    for s, j, b in freed:
        at = tables.data_ptr() + (s * tables.stride(0) + j) * entry
        assert not np.any(addr == at), f"table entry ({s}, {j}) of a freed block read"
        for cache in (k_cache, v_cache):
            lo = cache.data_ptr() + b * block
            assert not np.any((addr >= lo) & (addr < lo + block)), f"freed block {b} read (sequence {s})"


# (block size, window): a window inside one block, exactly one block, spanning blocks (not a multiple
# of the block), and one token (a query sees only itself); tiles of 16 positions: blocks of 4 and 8
# read an entry per position, blocks of 16 and 32 one per tile.
WINDOWS = [(8, 3), (8, 8), (4, 11), (16, 16), (32, 21), (16, 1)]


@pytest.mark.parametrize("block_size,window", WINDOWS)
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["single", "split3", "planned"])
def test_decode_with_window_matches_reference_and_reads_nothing_before_it(reads, block_size, window, num_splits):
    gen = torch.Generator().manual_seed(block_size * 7 + window)
    hkv, group = 2, 2
    ctx_lens = [1, window, 2 * block_size + 3, 37, 5 * block_size + window]
    k_cache, v_cache, tables = _paged(ctx_lens, block_size, hkv, gen)
    # The reference without a window over the last W positions, computed before any poisoning.
    q = torch.randn(len(ctx_lens), hkv * group, HEAD_DIM, generator=gen).to(DEV)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    full_out, _ = ref.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    kept = torch.zeros(len(ctx_lens), max(ctx_lens), dtype=torch.bool, device=DEV)
    for s, n in enumerate(ctx_lens):
        kept[s, max(0, n - window):n] = True
    as_kept, as_kept_lse = ref.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25, kept)
    freed = _free_before_window(k_cache, v_cache, tables, [max(0, n - window) for n in ctx_lens], block_size)
    assert freed
    out, lse = paged_attention.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, max(ctx_lens),
                                                num_splits=num_splits, block_n=16, window=window)
    _assert_never_read(reads, freed, k_cache, v_cache, tables)
    exp_out, exp_lse = ref.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25, window=window)
    assert torch.isfinite(exp_out).all() and torch.isfinite(out).all()
    torch.testing.assert_close(out, exp_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, exp_lse, rtol=1e-4, atol=1e-4)
    # The window is the last W positions: the same as keeping only those (a kept mask), and not the
    # whole context wherever the context is longer than the window.
    torch.testing.assert_close(exp_out, as_kept, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(exp_lse, as_kept_lse, rtol=1e-5, atol=1e-5)
    longer = lens > window
    assert not torch.allclose(exp_out[longer], full_out[longer], atol=1e-3)
    torch.testing.assert_close(exp_out[~longer], full_out[~longer], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size,window", WINDOWS)
def test_prefill_with_window_matches_reference_and_reads_nothing_before_it(reads, block_size, window):
    gen = torch.Generator().manual_seed(50 + block_size * 7 + window)
    hkv, group = 2, 2
    # cached tokens before each chunk; the last chunk's first query sees from a block boundary on
    starts = [0, 2 * block_size + 5, 40, block_size + window - 1]
    lens = [3 * block_size + 2, block_size + 5, 1, 20]
    ctx_lens = [s + n for s, n in zip(starts, lens)]
    k_cache, v_cache, tables = _paged(ctx_lens, block_size, hkv, gen)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = torch.randn(sum(lens), hkv * group, HEAD_DIM, generator=gen).to(DEV)
    st = torch.tensor(starts, dtype=torch.int32, device=DEV)
    full = ref.prefill_attention_ref(q, k_cache, v_cache, tables, cu, st, 0.25)
    # Per query, a window is a kept mask over its last W positions: check the reference row by row.
    rows = []
    for s, (start, n) in enumerate(zip(starts, lens)):
        for i in range(n):
            p = start + i
            kept = torch.zeros(1, p + 1, dtype=torch.bool, device=DEV)
            kept[0, max(0, p - window + 1):] = True
            one_q = q[int(cu[s]) + i][None]
            rows.append(ref.decode_attention_ref(one_q, k_cache, v_cache, tables[s:s + 1],
                                                 torch.tensor([p + 1], dtype=torch.int32, device=DEV), 0.25,
                                                 kept)[0][0])
    by_row = torch.stack(rows)
    freed = _free_before_window(k_cache, v_cache, tables, [max(0, s - window + 1) for s in starts], block_size)
    assert freed
    got = paged_attention.prefill_attention(q, k_cache, v_cache, tables, cu, st, 0.25, max(lens),
                                            block_m=16, block_n=16, window=window)
    _assert_never_read(reads, freed, k_cache, v_cache, tables)
    exp = ref.prefill_attention_ref(q, k_cache, v_cache, tables, cu, st, 0.25, window=window)
    assert torch.isfinite(exp).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(exp, by_row, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(exp, full, atol=1e-3)


def test_window_of_a_whole_context_changes_nothing():
    """W at least the context: the windowed kernels give full attention's result bit for bit."""
    gen = torch.Generator().manual_seed(77)
    ctx_lens = [9, 30]
    k_cache, v_cache, tables = _paged(ctx_lens, 4, 2, gen)
    q = torch.randn(2, 4, HEAD_DIM, generator=gen).to(DEV)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    for window in (30, 31, 1000):
        got = paged_attention.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 30, num_splits=2,
                                               block_n=16, window=window)
        want = paged_attention.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 30, num_splits=2,
                                                block_n=16)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_windowed_decode_plans_splits_over_the_window():
    """A planned windowed decode splits what it attends to, not the whole context."""
    assert tuning.attended_lens([100, 5000, 3], 128) == [100, 128, 3]
    assert tuning.attended_lens([100, 5000], 0) == [100, 5000]
    assert tuning.plan_decode_splits(tuning.attended_lens([32768], 128), 8)[0] == 1


# ---------------------------------------------------------------------------------------------
# Decode design: per-sequence splits, the single-split path, fp8 refused


def test_split_plan_follows_each_sequence_not_the_longest():
    """One 32k sequence among 255 of 1k: the long one is cut to the short ones' length (~29 splits)
    instead of running as one straggler program per KV head; the short ones are not split."""
    plan = tuning.plan_decode_splits([1024] * 255 + [32768], num_kv_heads=8)
    assert set(plan[:255].tolist()) == {1}
    assert plan[255] >= 16
    # A lone long sequence fills the GPU; a lone short one is not cut below MIN_SPLIT_TOKENS.
    assert tuning.plan_decode_splits([32768], 8)[0] == tuning.MAX_SPLITS
    assert tuning.plan_decode_splits([300], 8)[0] == 2
    assert tuning.plan_decode_splits([1], 8)[0] == 1


def test_decode_with_ragged_per_sequence_splits_matches_reference():
    """Splits per sequence as a tensor (the CUDA-graph form), each sequence a different count, some
    with splits past its tiles (empty) and a grid larger than any sequence needs."""
    gen = torch.Generator().manual_seed(11)
    ctx_lens = [1, 70, 200, 33, 129]
    k_cache, v_cache, tables = _paged(ctx_lens, 8, 2, gen)
    q = torch.randn(len(ctx_lens), 8, HEAD_DIM, generator=gen).to(DEV)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    splits = torch.tensor([1, 3, 7, 4, 2], dtype=torch.int32, device=DEV)
    out, lse = paged_attention.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 200, num_splits=splits,
                                                block_n=16, max_splits=9)
    exp_out, exp_lse = ref.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(out, exp_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, exp_lse, rtol=1e-4, atol=1e-4)


def test_single_split_decode_skips_the_merge_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(12)
    k_cache, v_cache, tables = _paged([40, 9], 4, 2, gen)
    q = torch.randn(2, 4, HEAD_DIM, generator=gen).to(DEV)
    lens = torch.tensor([40, 9], dtype=torch.int32, device=DEV)
    merges = []
    real = paged_attention._decode_merge_kernel

    class Spy:
        def __getitem__(self, grid):
            merges.append(grid)
            return real[grid]

    monkeypatch.setattr(paged_attention, "_decode_merge_kernel", Spy())
    out, lse = paged_attention.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 40, num_splits=1, block_n=16)
    assert merges == []
    exp_out, exp_lse = ref.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(out, exp_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, exp_lse, rtol=1e-4, atol=1e-4)
    paged_attention.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 40, num_splits=2, block_n=16)
    assert len(merges) == 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_kv_cache_is_refused_clearly(backend):
    """A bf16 x fp8 tl.dot would not compile on a GPU; every backend refuses the cache dtype up front."""
    gen = torch.Generator().manual_seed(13)
    k_cache, v_cache, tables = _paged([20], 4, 2, gen)
    q = torch.randn(1, 4, HEAD_DIM, generator=gen).to(DEV, torch.bfloat16)
    lens = torch.tensor([20], dtype=torch.int32, device=DEV)
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8 KV"):
        kernels.decode_attention(q, k8, v8, tables, lens, 0.25, 20, backend=backend)
    with pytest.raises(ValueError, match="fp8 KV"):
        kernels.prefill_attention(q, k8, v8, tables, torch.tensor([0, 1], dtype=torch.int32, device=DEV),
                                  torch.tensor([19], dtype=torch.int32, device=DEV), 0.25, 1, backend=backend)


# ---------------------------------------------------------------------------------------------
# Production shapes and dtypes (interpreter): head dim 128, the default 64-wide tiles

PROD_HEAD_DIM, PROD_BLOCK = 128, 16
# Tolerances (rtol, atol) against the float32 reference over the same bf16/fp16 values. Scores and
# the softmax statistics are float32 in the kernel (products of 16-bit values are exact in float32),
# so lse matches to float32 rounding; the output carries the probabilities rounded to the cache dtype
# before the PV dot and its own final rounding: ~2 ulp of the dtype (bf16 2^-8, fp16 2^-11). Measured
# on these cases: bf16 2.8e-3, fp16 1.5e-4 largest absolute error on outputs up to 3; lse 1e-6.
TOL = {torch.bfloat16: dict(out=(8e-3, 8e-3), lse=(1e-5, 1e-5)),
       torch.float16: dict(out=(1e-3, 1e-3), lse=(1e-5, 1e-5))}


@pytest.fixture
def bf16_dot(monkeypatch):
    """Widen bf16 tl.dot operands to float32 in the interpreter (see the module docstring)."""
    if DEV == "cuda":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype == tl.bfloat16:  # raw bf16 bits are the high half of the float32
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return real(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _prod_decode(dtype, group, num_splits, ctx_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    k_cache, v_cache, tables = _paged(ctx_lens, PROD_BLOCK, hkv, gen, head_dim=PROD_HEAD_DIM, dtype=dtype)
    q = torch.randn(len(ctx_lens), hkv * group, PROD_HEAD_DIM, generator=gen).to(DEV, dtype)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    scale = PROD_HEAD_DIM ** -0.5
    out, lse = paged_attention.decode_attention(q, k_cache, v_cache, tables, lens, scale, max(ctx_lens),
                                                num_splits=num_splits)
    exp_out, exp_lse = ref.decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    assert out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), exp_out, rtol=tol["out"][0], atol=tol["out"][1])
    torch.testing.assert_close(lse, exp_lse, rtol=tol["lse"][0], atol=tol["lse"][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group,num_splits", [(4, None), (8, 1)], ids=["gqa4-planned", "gqa8-single"])
def test_decode_production_shape(bf16_dot, dtype, group, num_splits):
    """Planned splits (here 1, 2 and 4 per sequence) and the single-split path, ragged last tiles."""
    ctx_lens = [1, 300, 1000]
    if num_splits is None:
        assert tuning.plan_decode_splits(ctx_lens, 2).tolist() == [1, 2, 4]
    _prod_decode(dtype, group, num_splits, ctx_lens, seed=group)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefill_production_shape(bf16_dot, dtype):
    """Default 64x64 tiles, GQA 4, a chunk over a cached prefix and a fresh prompt."""
    gen = torch.Generator().manual_seed(21)
    hkv, group = 2, 4
    starts, lens = [0, 150], [70, 40]
    ctx_lens = [s + n for s, n in zip(starts, lens)]
    k_cache, v_cache, tables = _paged(ctx_lens, PROD_BLOCK, hkv, gen, head_dim=PROD_HEAD_DIM, dtype=dtype)
    cu = torch.tensor([0, 70, 110], dtype=torch.int32, device=DEV)
    st = torch.tensor(starts, dtype=torch.int32, device=DEV)
    q = torch.randn(110, hkv * group, PROD_HEAD_DIM, generator=gen).to(DEV, dtype)
    scale = PROD_HEAD_DIM ** -0.5
    got = paged_attention.prefill_attention(q, k_cache, v_cache, tables, cu, st, scale, 70)
    exp = ref.prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, cu, st, scale)
    torch.testing.assert_close(got.float(), exp, rtol=TOL[dtype]["out"][0], atol=TOL[dtype]["out"][1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_production_shape_long_batch(bf16_dot, dtype):
    """8 sequences up to 16k, GQA 8, the default plan: the longest cut into the most splits (64, the
    merge's widest tile), the shortest not split."""
    ctx_lens = [16384, 1, 2500, 17, 9000, 640, 64, 1025]
    assert tuning.plan_decode_splits(ctx_lens, 2).tolist() == [64, 1, 10, 1, 36, 3, 1, 5]
    _prod_decode(dtype, 8, None, ctx_lens, seed=5)


def test_the_kernels_folder_never_shadows_an_installed_kernels_package(tmp_path):
    """kernels/ is kvbench.kernels; run from a checkout's root (its folder first on sys.path), a bare
    ``import kernels`` must still reach an installed package of that name (Hugging Face's, which
    transformers >= 5.25 requires and imports), and kvbench's own kernels stay where they are."""
    import subprocess
    import sys as _sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text('WHOSE = "installed"\n')
    code = ("import kernels; from kvbench import kernels as ours; "
            "print(getattr(kernels, 'WHOSE', None), ours.__name__, callable(ours.decode_attention))")
    out = subprocess.run([_sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["installed", "kvbench.kernels", "True"]
