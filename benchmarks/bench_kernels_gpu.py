"""GPU benchmark of kvbench's paged-KV kernels: one command, one table.

    python benchmarks/bench_kernels_gpu.py [--out benchmarks/kernels_gpu.md] [--budget-s 420] [--quick]

1. Checks every kernel against its torch reference at real shapes (Llama-3-8B attention: 32 query
   heads, 8 KV heads, head dim 128) in bf16.
2. Measures the device's copy bandwidth (the floor: KV bytes a decode must read / that bandwidth).
3. Times split-KV decode over a shuffled paged table at block sizes 8-128 and contexts 1k-32k, the
   same kernel over a one-block-per-sequence (slab) table of the same memory, and torch SDPA over
   contiguous KV; each next to the floor.
4. Times prefill (paged vs slab vs SDPA), with and without a cached prefix.

Prints one markdown table and writes it to --out. On a machine without CUDA it says so and exits 0.
Every section is guarded: a failure prints an error row and the run goes on; --budget-s stops timing
early (rows left out are listed) so the file is always written.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
import tempfile
import time
import traceback

import torch

HQ, HKV, D = 32, 8, 128  # Llama-3-8B attention shape
DEV = "cuda"
DTYPE = torch.bfloat16
# Sizes of the real run; --cpu-dry-run shrinks them to exercise this script in Triton's interpreter.
SIZES = dict(check_blocks=4096, check_lens=[4096, 1000, 2900, 17, 3333, 2048, 64, 1], check_width=256,
             prefill_check=([0, 1500, 37, 4000], [2048, 700, 1, 96]), write_tokens=3000, copy_blocks=512,
             contexts=[1024, 4096, 16384, 32768], quick_contexts=[1024, 8192], block_sizes=[8, 16, 32, 64, 128],
             quick_block_sizes=[16, 128], batch=lambda ctx: 64 if ctx <= 16384 else 32,
             prefill_cases=[(8, 1024, 0), (4, 4096, 0), (4, 2048, 8192), (1, 8192, 0)],
             quick_prefill_cases=[(4, 2048, 0), (4, 2048, 8192)], copy_bytes=1 << 30)
DRY_SIZES = dict(check_blocks=64, check_lens=[40, 17, 1, 33], check_width=8,
                 prefill_check=([0, 20, 3], [17, 9, 1]), write_tokens=30, copy_blocks=16,
                 contexts=[64], quick_contexts=[64], block_sizes=[8, 64], quick_block_sizes=[8],
                 batch=lambda ctx: 2, prefill_cases=[(2, 16, 0), (1, 16, 32)],
                 quick_prefill_cases=[(2, 16, 0)], copy_bytes=1 << 20)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_kernels():
    """kvbench.kernels, from an install or straight from the checkout (kernels/ maps to kvbench.kernels)."""
    try:
        import kvbench.kernels  # noqa: F401
    except ImportError:
        sys.path.insert(0, ROOT)
        import kvbench  # noqa: F401  (the package itself imports nothing heavy)
        spec = importlib.util.spec_from_file_location(
            "kvbench.kernels", os.path.join(ROOT, "kernels", "__init__.py"),
            submodule_search_locations=[os.path.join(ROOT, "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["kvbench.kernels"] = mod
        spec.loader.exec_module(mod)
    from kvbench.kernels import cache_ops, paged_attention, reference
    return cache_ops, paged_attention, reference


class Table:
    def __init__(self, out: str):
        self.out, self.lines = out, []

    def section(self, title: str, header: list[str]):
        self.lines += ["", f"### {title}", "", "| " + " | ".join(header) + " |",
                       "|" + "---|" * len(header)]
        self._print(self.lines[-5:])

    def row(self, *cells):
        line = "| " + " | ".join(c if isinstance(c, str) else f"{c:.4g}" for c in cells) + " |"
        self.lines.append(line)
        self._print([line])

    def note(self, text: str):
        self.lines += ["", text]
        self._print(["", text])

    def _print(self, lines):
        print("\n".join(lines), flush=True)

    def write(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.out)), exist_ok=True)
        with open(self.out, "w", encoding="utf-8") as fh:
            fh.write("\n".join(self.lines) + "\n")


def bench_ms(fn) -> float:
    if DEV != "cuda":  # dry run: one timed call, the numbers mean nothing
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written (as datasheets count HBM)."""
    n = SIZES["copy_bytes"]  # 1 GiB each way: far past the L2
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * n / (ms / 1e3)


def paged_tables(batch: int, ctx: int, block_size: int, gen) -> torch.Tensor:
    """Shuffled block tables covering blocks [0, batch * ctx / block_size): int32 [batch, ctx / block_size]."""
    per = ctx // block_size
    perm = torch.randperm(batch * per, generator=gen).to(torch.int32)
    return perm.view(batch, per).to(DEV)


# --------------------------------------------------------------------------------------------- checks


def check_kernels(t: Table, cache_ops, pa, ref):
    t.section("Correctness at real shapes, bf16 (max abs error vs torch reference in float32)",
              ["kernel", "shape", "max abs err", "tolerance", "result"])
    gen = torch.Generator().manual_seed(0)
    bs, nb = 16, SIZES["check_blocks"]
    k_cache = torch.randn(nb, bs, HKV, D, generator=gen).to(DEV, DTYPE)
    v_cache = torch.randn(nb, bs, HKV, D, generator=gen).to(DEV, DTYPE)
    perm = torch.randperm(nb, generator=gen).to(torch.int32)

    def report(name, shape, err, tol):
        t.row(name, shape, err, tol, "ok" if err <= tol else "FAIL")

    def guarded(name, fn):
        try:
            fn()
        except Exception as e:  # keep going: the other kernels still get checked
            t.row(name, "-", "-", "-", f"ERROR {type(e).__name__}: {str(e)[:80]}")
            traceback.print_exc()

    def write():
        kc, vc = k_cache.clone(), v_cache.clone()
        kr, vr = k_cache.clone(), v_cache.clone()
        n = SIZES["write_tokens"]
        k = torch.randn(n, HKV, D, device=DEV, dtype=DTYPE)
        v = torch.randn_like(k)
        slots = torch.randperm(nb * bs, device=DEV)[:n]
        cache_ops.write_kv(kc, vc, k, v, slots)
        ref.write_kv_ref(kr, vr, k, v, slots)
        report("write_kv", f"{n} tokens", float(max((kc - kr).abs().max(), (vc - vr).abs().max())), 0.0)

    def copy():
        nbp = SIZES["copy_blocks"]
        pool = torch.randn(2 * 4, nbp, bs, HKV, D, device=DEV, dtype=DTYPE)
        pairs = torch.randperm(nbp, device=DEV)[:nbp // 8 * 2].view(-1, 2)
        a, b = pool.clone(), pool.clone()
        cache_ops.copy_blocks(a, pairs)
        ref.copy_blocks_ref(b, pairs)
        report("copy_blocks", f"{pairs.shape[0]} pairs x 8 planes", float((a - b).abs().max()), 0.0)

    lens, width = SIZES["check_lens"], SIZES["check_width"]
    tables = perm[:len(lens) * width].view(len(lens), width).to(DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), HQ, D, device=DEV, dtype=DTYPE)
    scale = D ** -0.5
    state = {}

    def decode():
        out, lse = pa.decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, max(lens))
        eo, el = ref.decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, scale)
        state["lse"] = el
        report("decode_attention", f"{len(lens)} seqs, ctx <= {max(lens)}", float((out.float() - eo).abs().max()), 2e-2)
        report("decode lse", "", float((lse - el).abs().max()), 2e-2)

    def weights():
        w = pa.attention_weights(q, k_cache, tables, seq_lens, state["lse"], scale, max(lens))
        ew = ref.attention_weights_ref(q.float(), k_cache.float(), tables, seq_lens, state["lse"], scale, max(lens))
        report("attention_weights", "", float((w - ew).abs().max()), 2e-2)

    def prefill():
        starts, qlens = SIZES["prefill_check"]
        cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        st = torch.tensor(starts, dtype=torch.int32, device=DEV)
        qp = torch.randn(sum(qlens), HQ, D, device=DEV, dtype=DTYPE)
        tb = perm[:len(starts) * width].view(len(starts), width).to(DEV)
        out = pa.prefill_attention(qp, k_cache, v_cache, tb, cu, st, scale, max(qlens))
        eo = ref.prefill_attention_ref(qp.float(), k_cache.float(), v_cache.float(), tb, cu, st, scale)
        report("prefill_attention", "4 chunks, cached prefixes", float((out.float() - eo).abs().max()), 2e-2)

    for name, fn in [("write_kv", write), ("copy_blocks", copy), ("decode_attention", decode),
                     ("attention_weights", weights), ("prefill_attention", prefill)]:
        guarded(name, fn)
    del k_cache, v_cache
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- timing


def time_decode(t: Table, pa, bw: float, deadline: float, quick: bool):
    t.section("Decode (one query per sequence, Llama-3-8B layer shape, bf16)",
              ["batch", "context", "block size", "paged us", "slab us", "SDPA us", "floor us",
               "paged/slab", "paged % of floor", "splits"])
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    gen = torch.Generator().manual_seed(1)
    contexts = SIZES["quick_contexts" if quick else "contexts"]
    block_sizes = SIZES["quick_block_sizes" if quick else "block_sizes"]
    skipped = []
    for ctx in contexts:
        batch = SIZES["batch"](ctx)  # KV of the largest case: 32 x 32k tokens x 4 KiB = 4 GiB
        tokens = batch * ctx
        # One memory for all layouts: token-major [tokens, Hkv, D], viewed as blocks of any size.
        k = torch.randn(tokens, HKV, D, device=DEV, dtype=DTYPE)
        v = torch.randn_like(k)
        q = torch.randn(batch, HQ, D, device=DEV, dtype=DTYPE)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        kv_bytes = 2 * tokens * HKV * D * 2
        floor_us = kv_bytes / bw * 1e6
        scale = D ** -0.5
        try:
            slab_tables = torch.arange(batch, dtype=torch.int32, device=DEV)[:, None]
            ks, vs = k.view(batch, ctx, HKV, D), v.view(batch, ctx, HKV, D)
            slab_us = bench_ms(lambda: pa.decode_attention(q, ks, vs, slab_tables, lens, scale, ctx)) * 1e3
            kq = ks.transpose(1, 2)  # [B, Hkv, ctx, D], strided view of the same memory
            vq = vs.transpose(1, 2)
            sdpa_us = bench_ms(lambda: sdpa(q[:, :, None], kq, vq, enable_gqa=True)) * 1e3
        except Exception as e:
            t.row(str(batch), str(ctx), "slab/SDPA", f"ERROR {type(e).__name__}: {str(e)[:60]}", "", "", "", "", "", "")
            traceback.print_exc()
            slab_us = sdpa_us = float("nan")
        for bs in block_sizes:
            if time.time() > deadline:
                skipped.append(f"decode ctx={ctx} bs={bs}")
                continue
            try:
                kb, vb = k.view(tokens // bs, bs, HKV, D), v.view(tokens // bs, bs, HKV, D)
                tables = paged_tables(batch, ctx, bs, gen)
                splits = pa.default_num_splits(batch, HKV, ctx)
                us = bench_ms(lambda: pa.decode_attention(q, kb, vb, tables, lens, scale, ctx)) * 1e3
                t.row(str(batch), str(ctx), str(bs), us, slab_us, sdpa_us, floor_us, us / slab_us,
                      f"{100 * floor_us / us:.0f}%", str(splits))
            except Exception as e:
                t.row(str(batch), str(ctx), str(bs), f"ERROR {type(e).__name__}: {str(e)[:60]}",
                      "", "", "", "", "", "")
                traceback.print_exc()
        del k, v
        torch.cuda.empty_cache()
    return skipped


def time_prefill(t: Table, pa, deadline: float, quick: bool):
    t.section("Prefill (causal, bf16; TFLOP/s counts the causal half)",
              ["chunks x tokens", "cached prefix", "block size", "paged ms", "slab ms", "SDPA ms", "paged TFLOP/s"])
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    gen = torch.Generator().manual_seed(2)
    scale = D ** -0.5
    skipped = []
    cases = SIZES["quick_prefill_cases" if quick else "prefill_cases"]
    for n, qlen, prefix in cases:
        if time.time() > deadline:
            skipped.append(f"prefill {n}x{qlen}+{prefix}")
            continue
        try:
            ctx = prefix + qlen
            ctx_pad = -(-ctx // 128) * 128
            k = torch.randn(n * ctx_pad, HKV, D, device=DEV, dtype=DTYPE)
            v = torch.randn_like(k)
            q = torch.randn(n * qlen, HQ, D, device=DEV, dtype=DTYPE)
            cu = torch.arange(0, n + 1, dtype=torch.int32, device=DEV) * qlen
            starts = torch.full((n,), prefix, dtype=torch.int32, device=DEV)
            flops = 4 * n * HQ * D * qlen * (prefix + qlen / 2)
            bs = 16
            tables = paged_tables(n, ctx_pad, bs, gen)
            kb, vb = k.view(-1, bs, HKV, D), v.view(-1, bs, HKV, D)
            paged_ms = bench_ms(lambda: pa.prefill_attention(q, kb, vb, tables, cu, starts, scale, qlen))
            slab_t = torch.arange(n, dtype=torch.int32, device=DEV)[:, None]
            ks, vs = k.view(n, ctx_pad, HKV, D), v.view(n, ctx_pad, HKV, D)
            slab_ms = bench_ms(lambda: pa.prefill_attention(q, ks, vs, slab_t, cu, starts, scale, qlen))
            if prefix == 0:
                qs = q.view(n, qlen, HQ, D).transpose(1, 2)
                kq = ks[:, :qlen].transpose(1, 2)
                vq = vs[:, :qlen].transpose(1, 2)
                sdpa_ms = bench_ms(lambda: sdpa(qs, kq, vq, is_causal=True, enable_gqa=True))
            else:
                sdpa_ms = float("nan")  # SDPA's causal mask assumes no prefix
            t.row(f"{n} x {qlen}", str(prefix), str(bs), paged_ms, slab_ms, sdpa_ms, flops / paged_ms / 1e9)
            del k, v, q
            torch.cuda.empty_cache()
        except Exception as e:
            t.row(f"{n} x {qlen}", str(prefix), "16", f"ERROR {type(e).__name__}: {str(e)[:60]}", "", "", "")
            traceback.print_exc()
    return skipped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="default benchmarks/kernels_gpu.md (dry run: a temp file)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop timing after this many seconds")
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="exercise this script on CPU in Triton's interpreter at toy sizes (no real numbers)")
    args = ap.parse_args()
    if args.cpu_dry_run:
        _dry_run_setup()
        args.out = args.out or os.path.join(tempfile.gettempdir(), "kernels_dry_run.md")
    elif not torch.cuda.is_available():
        print("bench_kernels_gpu: no CUDA device here; this benchmark only runs on a GPU (nothing measured).",
              file=sys.stderr)
        return 0
    args.out = args.out or os.path.join(ROOT, "benchmarks", "kernels_gpu.md")
    t0 = time.time()
    deadline = t0 + args.budget_s
    cache_ops, pa, ref = _import_kernels()
    import triton
    t = Table(args.out)
    name = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (dry run in Triton's interpreter: not a measurement)"
    t.lines.append(f"## kvbench kernels on {name}, {datetime.date.today().isoformat()}")
    t.note(f"torch {torch.__version__}, triton {triton.__version__}; shapes: {HQ} query heads, {HKV} KV heads, "
           f"head dim {D}; paged tables are shuffled; slab = the same kernel over one block per "
           "sequence; floor = KV bytes read / measured copy bandwidth.")
    skipped = []
    try:
        check_kernels(t, cache_ops, pa, ref)
    except Exception:
        traceback.print_exc()
    try:
        bw = copy_bandwidth()
        t.note(f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s")
    except Exception:
        traceback.print_exc()
        bw = 4.3e12
        t.note("copy bandwidth: measurement failed, using 4.3 TB/s")
    for section in (lambda: time_decode(t, pa, bw, deadline, args.quick),
                    lambda: time_prefill(t, pa, deadline, args.quick)):
        try:
            skipped += section()
        except Exception:
            traceback.print_exc()
        t.write()  # keep what we have even if a later section dies
    if skipped:
        t.note(f"left out (budget of {args.budget_s:.0f} s spent): " + ", ".join(skipped))
    t.note(f"total {time.time() - t0:.0f} s")
    t.write()
    print(f"\nwritten to {args.out}", file=sys.stderr)
    return 0


def _dry_run_setup() -> None:
    global DEV, DTYPE, HQ, HKV, D, SIZES
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    DEV, DTYPE, HQ, HKV, D, SIZES = "cpu", torch.float32, 8, 2, 16, DRY_SIZES

if __name__ == "__main__":
    sys.exit(main())
