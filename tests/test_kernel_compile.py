"""Every kernel compiled ahead of time for real GPU targets on this CPU-only machine (kernels/aot.py), with
the specialisation a real launch gets: it compiles, the decode path does not spill registers, shared
memory stays within the target's limit, K/V are read with 16-byte vector loads, a position's block is a
shift and a tile inside one block reads one table entry, and one split launches no merge.

The default run compiles kernels/aot.py's representative grid for sm_80 and sm_90 (and the production
decode for sm_100), and checks the two rules the full grid relies on: launches that share Triton's
cache key compile to the same code (so each is compiled once), and the parallel grid gives each point
its own kernels. The full grid (every dtype, head dim, GQA group, block size 1-128, kept mask, for sm_80
and sm_90) is marked slow and is its own step of .ci/run. Triton's on-disk cache makes a second run of
either fast.
"""
import importlib.util
import re

import pytest
from kvbench.kernels import aot
from kvbench.kernels.aot import Spec

# Not importorskip: importing triton here, at collection, would fix its own @triton.jit helpers
# (tl.cdiv, ...) in compiler mode before tests/test_kernels.py turns the interpreter on. The compiles
# run in spawned workers (kernels/aot.py) and import triton there.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

ARCHS = (80, 90)
PRODUCTION_DECODE = Spec("decode", group=8)  # Llama-3-70B's GQA 8


def _check_resources(spec: Spec, compiled) -> None:
    """Shared memory within the target's limit; no register spills (the decode path above all: a spill
    there is local-memory traffic on every tile of every step)."""
    for c in compiled:
        assert c.smem_bytes <= aot.smem_limit(c.arch), f"{spec.label()} {c.kernel}: {c.smem_bytes} B shared"
        assert c.spill_bytes == 0, f"{spec.label()} {c.kernel} sm_{c.arch}: {c.spill_bytes} B spilled"
        assert c.num_warps > 0 and c.regs > 0


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("spec", aot.representative_grid(), ids=Spec.label)
def test_representative_kernels_compile_within_resources(spec, arch):
    _check_resources(spec, aot.compile_spec(spec, arch))


def test_production_decode_compiles_for_sm_100():
    """Blackwell through the bundled ptxas-blackwell."""
    _check_resources(PRODUCTION_DECODE, aot.compile_spec(PRODUCTION_DECODE, 100))


@pytest.mark.parametrize("spec,arch", [(Spec("prefill"), 80), (Spec("decode1", group=1), 90)],
                         ids=["prefill-sm_80", "decode-gqa1-sm_90"])
def test_launch_table_warps_are_the_ones_compiled(spec, arch):
    """The launch table's warps reach the compiled kernel (at 4 warps both of these spilled)."""
    (c,) = aot.compile_spec(spec, arch)
    assert c.num_warps == 8 and c.num_stages == 2 and c.spill_bytes == 0


def _loads_by_width(c) -> dict[int, int]:
    out: dict[int, int] = {}
    for (_, nbytes), n in c.load_counts.items():
        out[nbytes] = out.get(nbytes, 0) + n
    return out


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("block_size", [16, 128])
def test_decode_reads_kv_in_16_byte_vectors(arch, block_size):
    """bf16 K and V tiles arrive in 16-byte accesses (ld.global.v4 or 16-byte cp.async); a change that
    breaks coalescing (lost alignment or divisibility, a non-contiguous head dim) leaves 2-byte scalar
    loads of bf16 elements, as the compile without the launch's attributes shows."""
    split = aot.compile_spec(Spec("decode", group=8, block_size=block_size), arch)[0]
    widths = _loads_by_width(split)
    assert widths.get(16, 0) >= 2, widths  # K and V
    assert 2 not in widths, widths  # no element-by-element bf16 loads
    assert sum(n for w, n in widths.items() if w < 16) <= 24, widths  # block table, lengths, q: a few


def test_decode_without_launch_attributes_would_load_scalars():
    """The vector-load check can fail: compiled without the alignment/divisibility a launch infers,
    the same decode reads K/V element by element (209 scalar loads on sm_90 when first measured)."""
    (bare,) = aot.compile_spec(Spec("decode1", group=8), 90, with_attrs=False)
    assert _loads_by_width(bare).get(2, 0) >= 64


@pytest.mark.parametrize("spec", [Spec("decode1", block_size=16), Spec("decode1", block_size=48),
                                  Spec("prefill", block_size=16)], ids=Spec.label)
def test_position_to_block_has_no_integer_division(spec):
    """BLOCK_SIZE is a compile-time constant: pos // BLOCK_SIZE and pos % BLOCK_SIZE become shifts and
    masks (a multiply for 48), never a div/rem instruction per position."""
    (c,) = aot.compile_spec(spec, 90)
    assert not re.findall(r"\b(?:div|rem)\.[su]\d+\b", c.ptx)


def _table_loads(c) -> list[str]:
    return [ln for ln in c.ttir.splitlines() if "tt.load" in ln and "ptr<i32>" in ln and "%blk" in ln]


def test_tile_inside_one_block_reads_one_table_entry():
    """Block 128 >= the 64-wide tile: one scalar block-table load per tile; block 16: one per position."""
    (big,) = aot.compile_spec(Spec("decode1", block_size=128), 90)
    (small,) = aot.compile_spec(Spec("decode1", block_size=16), 90)
    assert [ln for ln in _table_loads(big) if "tensor<" in ln] == [] and _table_loads(big)
    assert all("tensor<64x" in ln for ln in _table_loads(small)) and _table_loads(small)


def test_one_split_launches_no_merge_kernel():
    assert [x.kernel for x in aot.launches(Spec("decode1"), 90)] == ["_decode_split_kernel"]
    assert [x.kernel for x in aot.launches(Spec("decode"), 90)] == ["_decode_split_kernel", "_decode_merge_kernel"]


@pytest.mark.parametrize("op", ["decode", "decode1", "prefill"])
def test_a_sliding_window_launches_only_kernels_of_the_grid(op):
    """The window is a runtime argument the JIT does not specialise on: a windowed launch (a window of
    1, 16, 4095 or 4096 tokens, values Triton would otherwise specialise as a constant or by
    divisibility by 16) has a full-attention launch's cache key, so the grid's kernels are the ones
    sliding layers run (a planned decode over a short window plans fewer splits: decode1's kernel)."""
    compiled = set(aot.spec_launch_keys(Spec(op), 90)) | set(aot.spec_launch_keys(Spec("decode1"), 90))
    for window in (1, 16, 4095, 4096):
        keys = aot.spec_launch_keys(Spec(op, window=window), 90)
        assert keys and set(keys) <= compiled, window
    assert aot.spec_launch_keys(Spec(op, window=4096), 90) == aot.spec_launch_keys(Spec(op), 90)


# ---------------------------------------------------------------------------------------------
# Compiling a grid: each distinct compile once (aot.launch_key), in parallel processes (aot.compile_grid)

# The representative grid and neighbours that differ from one of its points in one setting which keeps
# the code's shape (GQA 4 vs 8 under the same 16-row tile; block 64 vs 128, both one table entry per
# tile; the kept mask; the target): each of those must stay its own compile. Their decode launches
# share merge kernels, which must be merged.
_KEY_SAMPLE = [*aot.representative_grid(), PRODUCTION_DECODE, Spec("decode", group=8, block_size=64)]


def _code(c) -> tuple:
    return c.kernel, c.arch, c.ptx, c.regs, c.spill_bytes, c.stack_bytes, c.smem_bytes, c.num_warps, c.num_stages


def test_launches_with_one_key_compile_to_the_same_code():
    """The grid's dedup rule, checked against compiling every launch on its own: two launches that
    share a key have the same PTX and resources, so merging them loses no check; at least one merge
    happens (the decode's merge kernel across groups and block sizes)."""
    code_by_key: dict[str, tuple] = {}
    launches = 0
    for arch in ARCHS:
        for spec in _KEY_SAMPLE:
            for key, c in zip(aot.spec_launch_keys(spec, arch), aot.compile_spec(spec, arch), strict=True):
                launches += 1
                assert code_by_key.setdefault(key, _code(c)) == _code(c), f"{spec.label()} sm_{arch} {c.kernel}"
    assert len(code_by_key) < launches


def test_grid_in_parallel_gives_each_point_its_own_kernels():
    """compile_grid in two processes with dedup gives every point what compiling it alone gives."""
    specs = [Spec("decode"), PRODUCTION_DECODE, Spec("decode1"), Spec("write_kv")]
    grid = aot.compile_grid(specs, ARCHS, workers=2)
    assert set(grid.points) == {(s, a) for s in specs for a in ARCHS}
    assert grid.compiles < grid.launches == sum(len(aot.compile_spec(s, a)) for s in specs for a in ARCHS)
    for (spec, arch), compiled in grid.points.items():
        assert [_code(c) for c in compiled] == [_code(c) for c in aot.compile_spec(spec, arch)], spec.label()


# ---------------------------------------------------------------------------------------------
# The full grid (slow: its own step of .ci/run)


def _point_failures(spec: Spec, compiled) -> list[str]:
    failed = [f"{spec.label()} {c.kernel} sm_{c.arch}: {c.error}" for c in compiled
              if isinstance(c, aot.CompileFailure)]
    if failed:
        return failed
    try:
        _check_resources(spec, compiled)
    except AssertionError as e:
        return [str(e)]
    # K and V in 16-byte vectors at every decode specialisation, not only the ones checked above.
    return [f"{spec.label()} sm_{c.arch}: K/V loads {_loads_by_width(c)}" for c in compiled
            if c.kernel == "_decode_split_kernel"
            and (_loads_by_width(c).get(16, 0) < 2 or 2 in _loads_by_width(c))]


@pytest.mark.slow
def test_every_specialisation_compiles():
    """Every launcher x bf16/fp16 x head dim 64/128 x GQA 1/2/4/7/8 x block 1-128 x kept mask, for sm_80
    and sm_90: each point compiles within its target's resources, and every decode reads K/V in
    16-byte vectors (each distinct compile runs once: the decode's merge kernels are shared)."""
    grid = aot.compile_grid(aot.full_grid(), ARCHS)
    assert len(grid.points) == len(aot.full_grid()) * len(ARCHS) and grid.compiles < grid.launches
    failures = [f for (spec, _), compiled in grid.points.items() for f in _point_failures(spec, compiled)]
    assert not failures, "\n".join(failures)
