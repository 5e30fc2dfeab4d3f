"""Ahead-of-time compilation of every kernel for a GPU target, on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) forgives what the compiler does not (tl.dot shapes and dtypes,
layouts, shared memory, registers), so the kernels are also compiled for real targets here and their
resources read back. A launch is compiled exactly as a real one would be: the public launcher
(paged_attention.decode_attention, ...) runs on small CPU tensors of the production dtype and
shapes while its kernels are swapped for recorders, and each recorded launch goes through Triton's
own JIT binder for the target, which infers what a launch infers (16-byte pointer alignment, integer
arguments divisible by 16 such as the cache strides) before ``triton.compile``. Without those
attributes the bf16 decode kernel reads K/V with 2-byte scalar loads instead of 16-byte vectors.

Registers and spills come from the ``ptxas -v`` log of Triton's own cubin stage, kept by a stage hook
(a CompiledKernel only learns them when loaded on a device; ptxas runs once per kernel); shared
memory, warps and stages from the kernel's metadata.

The whole grid (``compile_grid``) keys every launch with Triton's own cache key first and compiles each
distinct key once, in one spawned process per CPU.

Compiles run in a spawned worker process (``compile_spec``): the interpreter leaves triton.language
patched after running a kernel that calls another @triton.jit function (triton 3.9's
InterpretedFunction.__call__ patches without restoring), and a process that ran the interpreter tests
can then no longer compile.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import multiprocessing
import os
import re
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch
from kvbench.kernels import tuning

TARGETS = (80, 90, 100)  # sm_80 (A100), sm_90 (H100/H200), sm_100 (B200: the bundled ptxas-blackwell)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_KERNEL_FILES = ("paged_attention", "cache_ops")


@functools.lru_cache(maxsize=1)
def compiler_modules() -> dict:
    """Fresh copies of the kernel modules whose @triton.jit functions compile (triton.jit picks the
    interpreter or the compiler when it decorates, so the session's kvbench.kernels modules may be
    the interpreter's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        mods = {}
        for name in _KERNEL_FILES:
            spec = importlib.util.spec_from_file_location(f"kvbench.kernels._aot_{name}",
                                                          os.path.join(here, f"{name}.py"))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod  # triton resolves a kernel's globals through its module
            spec.loader.exec_module(mod)
            mods[name] = mod
        return mods
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


@dataclass(frozen=True)
class Launch:
    kernel: str  # the @triton.jit function's name
    fn: object  # the JITFunction
    grid: tuple
    args: tuple
    kwargs: dict = field(hash=False)


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kwargs)`` is noted, not run."""

    def __init__(self, fn, log: list):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(Launch(self.fn.__name__, self.fn, grid, args, kwargs))


@contextlib.contextmanager
def recording(arch: int):
    """Within: the compiler-mode modules' kernels are recorders, CPU tensors stand for ``arch``.
    Yields (modules, launches list)."""
    from triton.runtime.jit import JITFunction

    mods = compiler_modules()
    log: list[Launch] = []
    saved = []
    for mod in mods.values():
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                saved.append((mod, name, obj))
                setattr(mod, name, _Recorder(obj, log))
    tuning.set_aot_arch(arch)
    try:
        yield mods, log
    finally:
        tuning.set_aot_arch(None)
        for mod, name, obj in saved:
            setattr(mod, name, obj)


# ---------------------------------------------------------------------------------------------
# What the engine launches


@dataclass(frozen=True)
class Spec:
    """One specialisation of one launcher. ``op``: decode (split plan for a batch of long contexts:
    split + merge kernels), decode1 (one split: the split kernel alone), prefill, weights, write_kv,
    copy_blocks. ``table_width``: block-table columns (its stride's divisibility by 16 is specialised).
    ``window``: a sliding window's tokens (0: full attention); the kernels take it unspecialised, so a
    windowed launch has full attention's key and the grid needs no point of its own for it."""

    op: str
    dtype: str = "bf16"
    head_dim: int = 128
    group: int = 4
    block_size: int = 16
    kept: bool = False
    num_kv_heads: int = 8
    table_width: int = 37
    window: int = 0

    def label(self) -> str:
        return (f"{self.op} {self.dtype} D{self.head_dim} G{self.group} bs{self.block_size}"
                + (" kept" if self.kept else "") + (f" W{self.window}" if self.window else ""))


def _call(spec: Spec, mods: dict) -> None:
    """Run the spec's public launcher on small CPU tensors of the production dtype and strides."""
    pa, ops = mods["paged_attention"], mods["cache_ops"]
    dt, d, hkv, bs = DTYPES[spec.dtype], spec.head_dim, spec.num_kv_heads, spec.block_size
    hq = hkv * spec.group
    s = 4
    k = torch.zeros(2, bs, hkv, d, dtype=dt)  # [NB, BS, Hkv, D]: strides do not depend on NB
    v = torch.zeros_like(k)
    tables = torch.zeros(s, spec.table_width, dtype=torch.int32)
    ctx = 4096 if spec.op == "decode" else 300
    lens = torch.full((s,), ctx, dtype=torch.int32)
    kept = torch.ones(s, ctx, dtype=torch.int8) if spec.kept else None
    scale = d ** -0.5
    if spec.op in ("decode", "decode1"):
        q = torch.zeros(s, hq, d, dtype=dt)
        pa.decode_attention(q, k, v, tables, lens, scale, ctx, num_splits=1 if spec.op == "decode1" else None,
                            kept=kept, window=spec.window)
    elif spec.op == "weights":
        q = torch.zeros(s, hq, d, dtype=dt)
        pa.attention_weights(q, k, tables, lens, torch.zeros(s, hq), scale, ctx - 3, kept)
    elif spec.op == "prefill":
        q = torch.zeros(3 * s, hq, d, dtype=dt)
        cu = torch.arange(0, 3 * s + 1, 3, dtype=torch.int32)
        pa.prefill_attention(q, k, v, tables, cu, torch.zeros(s, dtype=torch.int32), scale, 3, kept,
                             window=spec.window)
    elif spec.op == "write_kv":
        new = torch.zeros(5, hkv, d, dtype=dt)
        ops.write_kv(k, v, new, new, torch.zeros(5, dtype=torch.int64))
    elif spec.op == "copy_blocks":
        pool = torch.zeros(4, 2, bs, hkv, d, dtype=dt)  # [2L, NB, BS, Hkv, D]
        ops.copy_blocks(pool, torch.zeros(1, 2, dtype=torch.int64))
    else:
        raise ValueError(f"unknown op {spec.op!r}")


def launches(spec: Spec, arch: int) -> list[Launch]:
    """The kernel launches the spec's launcher makes on ``arch`` (num_warps/num_stages from its table)."""
    with recording(arch) as (mods, log):
        _call(spec, mods)
    return log


# ---------------------------------------------------------------------------------------------
# Compiling and reading resources


@dataclass(frozen=True)
class Compiled:
    kernel: str
    arch: int
    regs: int
    spill_bytes: int  # spill stores + spill loads (ptxas -v)
    stack_bytes: int
    smem_bytes: int
    num_warps: int
    num_stages: int
    loads: tuple  # ((kind, bytes per access), count) over the PTX's global loads, sorted
    ptx: str = field(repr=False, compare=False)
    ttir: str = field(repr=False, compare=False)  # Triton IR: loads still carry their tensor shapes

    @property
    def load_counts(self) -> Counter:
        return Counter(dict(self.loads))


_LD = re.compile(r"\bld\.global(?:\.[a-z0-9_]+)*?(?:\.v(\d))?\.[bfsu](\d+)\b")
_CP_ASYNC = re.compile(r"\bcp\.async\.c[ag]\.shared\.global(?:\.[a-zA-Z0-9_]+)*"
                       r"\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)")


def global_loads(ptx: str) -> Counter:
    """Global loads in PTX by (kind, bytes per thread access): ld.global (.v2/.v4 vectors) and cp.async
    (global -> shared, the pipelined loads of a multi-stage loop)."""
    out = Counter()
    for vec, bits in _LD.findall(ptx):
        out[("ld.global", int(vec or 1) * int(bits) // 8)] += 1
    for size in _CP_ASYNC.findall(ptx):
        out[("cp.async", int(size, 0))] += 1
    return out


_PTXAS_HOOK_KEY = "kvbench-aot-ptxas-log"


def _ptxas_log_hook(*args):
    """Triton stage-inspection hook (knobs.runtime.add_stages_inspection_hook): Triton's own cubin stage
    runs ``ptxas -v`` and drops its log; this wraps the stage to keep the log's registers, spills and
    stack frame in the kernel's metadata (and so in Triton's on-disk cache), so each kernel is
    assembled by ptxas once, with exactly the flags of a real launch. Called without arguments,
    Triton asks for the key it adds to its cache key (entries compiled without the hook lack the log)."""
    if not args:
        return _PTXAS_HOOK_KEY, _PTXAS_HOOK_KEY
    _backend, stages, _options, _language, _capability = args
    make_cubin = stages["cubin"]

    def cubin(src, metadata):
        from triton import knobs

        log = io.StringIO()
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True  # make_cubin prints the log of a successful ptxas run
            out = make_cubin(src, metadata)
        metadata["ptxas_info"] = _parse_ptxas_log(log.getvalue())
        return out

    stages["cubin"] = cubin


def _parse_ptxas_log(log: str) -> dict:
    """Registers, spills (stores + loads) and stack frame of the one kernel in a ``ptxas -v`` log."""
    if "Used " not in log:
        raise RuntimeError(f"no ptxas -v report in the cubin stage's output: {log[:300]!r}")

    def num(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {"regs": num(r"Used (\d+) registers"), "stack": num(r"(\d+) bytes stack frame"),
            "spills": num(r"(\d+) bytes spill stores") + num(r"(\d+) bytes spill loads")}


def _source(launch: Launch, arch: int, with_attrs: bool = True):
    """-> (ASTSource, GPUTarget, backend, options dict): what Triton's JIT would compile for this launch
    on ``arch``. The JIT's own binder and argument packing (JITFunction.run, triton 3.9): same signature,
    constexprs and attributes (16-byte alignment, divisibility by 16) as a launch with these arguments."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    return ASTSource(fn, signature, constexprs, attrs if with_attrs else {}), target, backend, options.__dict__


def launch_key(launch: Launch, arch: int, with_attrs: bool = True) -> str:
    """Triton's own cache key for compiling this launch for ``arch``: the kernel's source and every
    @triton.jit function it calls, the argument types, the constexpr values, the alignment and
    divisibility attributes, the compile options (warps, stages, maxnreg, ...), the target and the
    ptxas and Triton versions. ``triton.compile`` is a function of exactly these (it returns its cache
    entry when they match), so two launches with the same key compile to the same kernel, and the
    grid compiles each key once. Any difference in them is a different key, even one that might not
    change the code (a group of 4 or 8 under the same 16-row tile): nothing is merged on a guess."""
    from triton.compiler.compiler import get_cache_invalidating_env_vars, get_cache_key

    src, _target, backend, options = _source(launch, arch, with_attrs)
    return get_cache_key(src, backend, backend.parse_options(options), get_cache_invalidating_env_vars())


def compile_launch(launch: Launch, arch: int, with_attrs: bool = True) -> Compiled:
    """Compile a recorded launch for ``arch`` as Triton's JIT would at that launch (``with_attrs=False``
    drops the inferred alignment/divisibility attributes, for comparison)."""
    import triton
    from triton import knobs

    src, target, _backend, options = _source(launch, arch, with_attrs)
    saved = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = _ptxas_log_hook
    try:
        kernel = triton.compile(src, target=target, options=options)
    finally:
        knobs.runtime.add_stages_inspection_hook = saved
    ptx = kernel.asm["ptx"]
    md = kernel.metadata
    info = md.ptxas_info
    return Compiled(launch.kernel, arch, info["regs"], info["spills"], info["stack"], md.shared, md.num_warps,
                    md.num_stages, tuple(sorted(global_loads(ptx).items())), ptx, kernel.asm["ttir"])


@functools.cache
def compile_spec_in_process(spec: Spec, arch: int, with_attrs: bool = True) -> tuple[Compiled, ...]:
    """Every kernel the spec's launcher launches, compiled for ``arch`` in this process (which must not
    have run the interpreter: see the module docstring); cached."""
    return tuple(compile_launch(launch, arch, with_attrs) for launch in launches(spec, arch))


def _compiler_mode() -> None:
    """Worker initializer: triton's own @triton.jit helpers (tl.cdiv, ...) must be imported in compiler
    mode, and a TRITON_INTERPRET=1 inherited from the parent would make them interpreter functions."""
    os.environ["TRITON_INTERPRET"] = "0"
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before the compile worker could turn the interpreter off")


def spawn_pool(workers: int = 1) -> ProcessPoolExecutor:
    """Fresh worker processes in compiler mode (spawned, not forked: a fork would inherit a patched
    triton.language and the parent's interpreter-mode triton)."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_compiler_mode)


@functools.cache
def _worker() -> ProcessPoolExecutor:
    return spawn_pool(1)


@functools.cache
def compile_spec(spec: Spec, arch: int, with_attrs: bool = True) -> tuple[Compiled, ...]:
    """compile_spec_in_process in a clean worker process (cached per session)."""
    return _worker().submit(compile_spec_in_process, spec, arch, with_attrs).result()


def _launch_keys(point: tuple[Spec, int]) -> tuple[str, ...]:
    spec, arch = point
    return tuple(launch_key(launch, arch) for launch in launches(spec, arch))


@functools.cache
def spec_launch_keys(spec: Spec, arch: int) -> tuple[str, ...]:
    """launch_key of each of the spec's launches on ``arch``, in the clean worker process (cached)."""
    return _worker().submit(_launch_keys, (spec, arch)).result()


@dataclass(frozen=True)
class CompileFailure:
    """A grid compile that raised (the grid reports every failure, not the first)."""

    kernel: str
    arch: int
    error: str


def _compile_nth_launch(job: tuple[Spec, int, int]) -> Compiled | CompileFailure:
    spec, arch, index = job
    launch = launches(spec, arch)[index]
    try:
        return compile_launch(launch, arch)
    except Exception as e:  # noqa: BLE001 -- a compile error is a result of the grid, reported per point
        return CompileFailure(launch.kernel, arch, f"{type(e).__name__}: {str(e)[:300]}")


@dataclass
class GridCompile:
    """The kernels of every grid point (spec, arch), each distinct compile run once (see launch_key)."""

    points: dict[tuple[Spec, int], tuple[Compiled | CompileFailure, ...]]
    launches: int  # kernel launches over all points
    compiles: int  # distinct keys: the compiles that ran


def compile_grid(specs, archs, workers: int | None = None) -> GridCompile:
    """Compile every (spec, arch) point's launches in ``workers`` spawned processes (default: one per
    CPU). First each point's launches are recorded and keyed (cheap: no compile); then each distinct
    key is compiled once, by the first point that launches it, and its result serves every point with
    that key. The compiles are handed out one at a time, so the processes stay busy to the end."""
    points = [(spec, arch) for arch in archs for spec in specs]
    with spawn_pool(workers or os.cpu_count() or 1) as pool:
        keys = list(pool.map(_launch_keys, points, chunksize=16))
        first: dict[str, tuple[Spec, int, int]] = {}
        for (spec, arch), point_keys in zip(points, keys, strict=True):
            for index, key in enumerate(point_keys):
                first.setdefault(key, (spec, arch, index))
        compiled = dict(zip(first, pool.map(_compile_nth_launch, first.values()), strict=True))
    return GridCompile({point: tuple(compiled[k] for k in point_keys) for point, point_keys in zip(points, keys)},
                       sum(map(len, keys)), len(first))


def smem_limit(arch: int) -> int:
    return tuning.SMEM_LIMIT[arch]


# ---------------------------------------------------------------------------------------------
# The grids the tests and benchmarks/kernel_resources.py compile

ATTENTION_OPS = ("decode", "decode1", "prefill", "weights")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


# GQA groups (query heads per KV head): 1 (multi-head models loaded from a folder), and the presets'
# (kvbench/executors/presets.py): tiny 2, Llama-3-8B / Mistral 4, Qwen2.5-7B 7, Llama-3-70B / Qwen3 8.
GROUPS = (1, 2, 4, 7, 8)


def full_grid() -> list[Spec]:
    """Every specialisation the engine can launch at the shipped presets: bf16/fp16, head dim 64/128,
    every preset's GQA group, power-of-two block sizes 1-128, with and without a kept mask, for every
    attention launcher; the cache kernels per dtype and head dim. (A block size that is not a power
    of two, or over 128, compiles the same code paths: representative_grid has one of each.)"""
    out = [Spec(op, dt, d, g, bs, kept) for op in ATTENTION_OPS for dt in DTYPES for d in (64, 128)
           for g in GROUPS for bs in BLOCK_SIZES for kept in (False, True)]
    out += [Spec(op, dt, d, 4, 16) for op in ("write_kv", "copy_blocks") for dt in DTYPES for d in (64, 128)]
    return out


def representative_grid() -> list[Spec]:
    """A sample of full_grid that touches every code path once (the default test run): each launcher
    at the production shape (bf16, head dim 128, Llama-3 GQA 4), the tile-in-one-block path (block
    128, and 48: not a power of two), one block per position (block 1), fp16, head dim 64, GQA 1 and
    8, the kept mask, a block table whose stride is divisible by 16; the GQA groups of the other
    presets: tiny's (head dim 64, GQA 2: what selfcheck launches first on a GPU) and Qwen2.5-7B's 7,
    a group that is not a power of two."""
    return [
        Spec("decode", head_dim=64, group=2), Spec("prefill", head_dim=64, group=2),
        Spec("decode", group=7, kept=True), Spec("prefill", group=7),
        Spec("decode"), Spec("decode1"), Spec("prefill"), Spec("weights", kept=True),
        Spec("decode", group=8, block_size=128), Spec("decode1", dtype="fp16", head_dim=64, group=1, block_size=1),
        Spec("decode1", group=8, block_size=48, kept=True, table_width=64),
        Spec("prefill", dtype="fp16", head_dim=64, group=8, block_size=128, kept=True),
        Spec("prefill", group=1, block_size=1), Spec("weights", dtype="fp16", group=8, block_size=128),
        Spec("write_kv"), Spec("copy_blocks"),
    ]
