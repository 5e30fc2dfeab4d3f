"""Every kernel compiled ahead of time for real GPU targets on this CPU-only machine (kernels/aot.py), with
the specialisation a real launch gets: it compiles, the decode path does not spill registers, shared
memory stays within the target's limit, K/V are read with 16-byte vector loads, a position's block is a
shift and a tile inside one block reads one table entry, and one split launches no merge.

The default run compiles kernels/aot.py's representative grid for sm_80 and sm_90 (and the production
decode for sm_100); the full grid (every dtype, head dim, GQA group, block size 1-128, kept mask) is
marked slow. Triton's on-disk cache makes a second run of either fast.
"""
import importlib.util
import os
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


# ---------------------------------------------------------------------------------------------
# The full grid (slow)


def _compile_and_check(item):
    spec, arch = item
    try:
        _check_resources(spec, aot.compile_spec_in_process(spec, arch))
        return None
    except Exception as e:  # noqa: BLE001 -- every failure of the grid is reported at once
        return f"{spec.label()} sm_{arch}: {type(e).__name__}: {str(e)[:300]}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
def test_every_specialisation_compiles(arch):
    """Every launcher x bf16/fp16 x head dim 64/128 x GQA 1/2/4/7/8 x block 1-128 x kept mask."""
    with aot.spawn_pool(os.cpu_count() or 1) as pool:
        failures = [f for f in pool.map(_compile_and_check, [(s, arch) for s in aot.full_grid()], chunksize=4) if f]
    assert not failures, "\n".join(failures)
