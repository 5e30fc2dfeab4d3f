"""Before a replay runs: the pool's size in blocks, what the trace and the model ask of the devices and
the pool (refused up front with a one-line error naming the request's line or the option), and the
requests as this run's settings shape them (--overlong)."""
from __future__ import annotations

import dataclasses

from kvbench.engine.config import ReplayConfig
from kvbench.engine.lengths import shape_one
from kvbench.errors import InputError, RunError
from kvbench.executors.presets import available_host_bytes
from kvbench.memory.groups import KVLayout, group_layers
from kvbench.memory.policies import needs_future
from kvbench.trace.format import Request
from kvbench.trace.tokens import TOKEN_HI

KV_MEM_FRACTION = 0.9  # share of free device memory given to the KV pool when no size is asked


def kv_layout_of(cfg: ReplayConfig, executor) -> KVLayout:
    """The model's KV cache groups at the run's block size (kvbench.memory.groups: one group for a
    plain model; vLLM's hybrid grouping for one with windowed layers, unless
    --disable-hybrid-kv-cache-manager). Unset, vLLM 0.34's default: its hybrid manager is off for a model
    with chunked local attention (Llama 4: VllmConfig.__post_init__ turns it off for the latency it
    costs, unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1), on for every other."""
    layers = executor.kv_layers()
    if not (cfg.prefix_cache and cfg.layout == "paged"):  # vLLM's "none" mode: no prefill checkpoints either
        layers = [dataclasses.replace(s, checkpoints=False) if s.checkpoints else s for s in layers]
    disable = cfg.disable_hybrid_kv_cache_manager
    if disable is None:
        disable = any(layer.kind == "chunked" for layer in layers)
    try:
        return group_layers(layers, cfg.block_size, disable)
    except ValueError as e:
        raise InputError(str(e), field="--disable-hybrid-kv-cache-manager" if disable else "--model") from None


def pool_blocks(cfg: ReplayConfig, executor, model=None, kv_layout: KVLayout | None = None) -> int:
    """Blocks in the KV pool: --num-blocks (no memory check: a pool of any size, for experiments),
    else --kv-mem (refused by an executor that knows its devices cannot hold it: check_kv_bytes), else
    the devices' memory after weights and activations; a block costs a page for each layer of the
    largest KV cache group (vLLM's planning: get_kv_cache_config_from_groups)."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    layout = kv_layout or kv_layout_of(cfg, executor)
    per_block = layout.bytes_per_block * cfg.tp  # (a layout is one GPU's; the pool's bytes are the group's)
    if cfg.kv_mem_bytes is not None:
        nbytes = cfg.kv_mem_bytes
        executor.check_kv_bytes(nbytes)
    else:
        nbytes = executor.default_kv_bytes()
    n = int(nbytes // per_block)
    if n < 1:
        msg = (f"a KV pool of {nbytes} bytes holds no block of {per_block} bytes ({cfg.block_size} tokens: "
               f"{layout.describe()})")
        if cfg.kv_mem_bytes is not None:
            raise InputError(msg, field="--kv-mem")
        raise RunError(msg, usage=True)
    return n


def check_hybrid(cfg: ReplayConfig, layout: KVLayout, model: str) -> None:
    """Refuse, in one line naming the option, what kvbench does not model for a model with several KV
    cache groups or a window (kvbench.memory.hybrid follows vLLM's hybrid manager in hash mode)."""
    if not layout.is_hybrid:
        return
    groups = layout.describe()
    why = None
    if cfg.layout == "slab" and cfg.executor == "model":
        why, field = "a slab holds every group in one reservation, which the model executor does not read", "--layout"
    elif cfg.layout == "paged" and cfg.prefix_cache and cfg.prefix_mode == "radix":
        why, field = ("radix mode follows SGLang's single-tree cache; SGLang runs such a model on its hybrid radix "
                      "caches (mem_cache/swa_radix_cache.py, mamba_radix_cache.py), not modelled: use --prefix-mode "
                      "hash, vLLM's"), "--prefix-mode"
    elif cfg.eviction != "none":
        why, field = "token eviction packs one block table", "--eviction"
    elif cfg.tier_sizes():
        why, field = ("the prefix-cache tiers and the shared store keep one table's blocks (vLLM 0.34's "
                      "OffloadingConnector offloads per group, which kvbench does not model yet)"), \
            f"--{next(iter(cfg.tier_sizes()))}-kv-mem"
    elif cfg.prefix_cache and needs_future(cfg.cache_policy):
        why, field = f"--cache-policy {cfg.cache_policy} reads one table's future", "--cache-policy"
    elif cfg.executor == "model" and any(g.kind not in ("full", "sliding") for g in layout.groups):
        why, field = ("the model executor runs full and sliding-window groups only (chunked local attention, MLA and "
                      "recurrent layers are not implemented in its forward)", "--executor")
    if why is not None:
        way_out = ("" if layout.has_state else  # (vLLM cannot run a recurrent state as attention)
                   "; use --disable-hybrid-kv-cache-manager to run it as full attention")
        raise InputError(f"{model} keeps its KV in groups ({groups}): {why}{way_out}", field=field)


def check_model_memory(cfg: ReplayConfig, model) -> None:
    """The model executor holds the weights and the KV pool on one device: what cannot fit is refused
    before a byte is allocated (InputError naming --model or --kv-mem), not met as an out-of-memory
    crash minutes later. The sim models GPUs it does not hold (its own check_kv_bytes)."""
    if cfg.executor != "model":
        return
    import torch

    from kvbench.executors.model import resolve_device
    from kvbench.executors.modeling import default_dtype

    dev = resolve_device(cfg.device)
    dtype = "fp32" if default_dtype(dev) == torch.float32 else "bf16"
    avail: int | None
    if dev.type == "cuda":
        avail, _ = torch.cuda.mem_get_info(dev)
        where = f"the {avail / 1e9:.1f} GB free on {torch.cuda.get_device_name(dev)}"
    else:
        avail = available_host_bytes()
        where = f"the {avail / 1e9:.1f} GB of host memory available" if avail is not None else ""
    if avail is None:
        return
    weights = model.weight_bytes(dtype)
    kv = cfg.kv_mem_bytes or 0
    if weights + kv > avail:
        pool = f" and a {kv / 1e9:.1f} GB KV pool (--kv-mem)" if kv else ""
        raise InputError(f"{model.name}'s weights ({weights / 1e9:.1f} GB in {dtype}){pool} do not fit in {where}: "
                         "use a smaller model or --kv-mem, another device, or --executor sim",
                         field="--kv-mem" if kv and weights <= avail else "--model")


def check_token_ids(requests: list[Request], vocab_size: int, trace_path: str) -> None:
    """The model executor embeds every token id: one outside the model's vocabulary is refused up
    front (InputError naming the trace line, or --model when the ids kvbench draws for shared and
    unique segments do not fit), not met as an IndexError in the middle of a run."""
    drawn = any(seg.kind in ("shared", "unique") for r in requests for seg in r.prompt) or any(
        r.output_len > 1 for r in requests)  # generated tokens are drawn too
    if drawn and vocab_size < TOKEN_HI:
        raise InputError(f"the model's vocabulary has {vocab_size:,} tokens; kvbench draws the ids of shared, "
                         f"unique and generated tokens below {TOKEN_HI:,}: use a model with a vocabulary of at "
                         f"least {TOKEN_HI:,}", field="--model")
    for r in requests:
        for j, seg in enumerate(r.prompt):
            if seg.kind == "tokens" and seg.tokens and max(seg.tokens) >= vocab_size:
                raise InputError(f"token id {max(seg.tokens)} is outside the model's vocabulary of {vocab_size:,}",
                                 file=trace_path, line=r.line, field=f"prompt[{j}].tokens")


def slab_reserve_tokens(requests: list[Request], cfg: ReplayConfig, max_len: int) -> int:
    """The slab baseline's reservation per sequence (``--slab-reserve max``): --max-model-len when
    given, else the longest request this run admits (prompt + output) rounded up to a block, so a
    slab is as long as the trace needs, not the model's whole context."""
    if cfg.max_model_len is not None:
        return cfg.max_model_len
    bs = cfg.block_size
    longest = max((r.prompt_len + r.output_len for r in requests if r.prompt_len + r.output_len <= max_len),
                  default=bs)
    return -(-longest // bs) * bs


def check_fits(r: Request, cfg: ReplayConfig, num_blocks: int, slab_reserve: int, trace_path: str,
               kv_layout: KVLayout | None = None, max_len: int = 1 << 30) -> None:
    """A request that cannot fit in the empty pool would stall the replay: say so up front (RunError,
    a usage error naming the trace line). So would a request with more samples than --max-num-seqs:
    kvbench forks a request's n samples in one admission, and n counts against the cap."""
    if r.n > cfg.max_num_seqs:
        raise RunError(f"{trace_path}:{r.line}: field 'n': request {r.id!r} has n={r.n} samples but "
                       f"--max-num-seqs is {cfg.max_num_seqs}: kvbench runs a request's samples together, "
                       f"so raise --max-num-seqs to {r.n} (vLLM would fan it out into {r.n} child requests "
                       "instead)", usage=True)
    bs = cfg.block_size
    if cfg.layout == "slab":  # a slab for each sample, reserved at admission (each group's slots)
        reserve = slab_reserve if cfg.slab_reserve == "max" else r.prompt_len + r.output_len
        need = r.n * (-(-reserve // bs) if kv_layout is None or not kv_layout.is_hybrid
                      else int(kv_layout.slab_blocks(reserve)))
    else:
        groups = 1 if kv_layout is None else len(kv_layout.groups)
        full = -(-(r.prompt_len + r.output_len) // bs)
        peak = full if kv_layout is None else int(kv_layout.peak_blocks(r.prompt_len + r.output_len,
                                                                        cfg.max_batched_tokens, max_len))
        need = peak + (r.n - 1) * (-(-r.output_len // bs)) * groups
    if need > num_blocks:
        samples = f" with n={r.n} samples" if r.n > 1 else ""
        where = f"{trace_path}:{r.line}: " + ("field 'n': " if r.n > 1 else "")
        raise RunError(
            f"{where}request {r.id!r}{samples} needs {need:,} KV blocks of {bs} tokens but the pool "
            f"holds {num_blocks:,}: give more memory (--kv-mem, --num-blocks) "
            "or lower --max-model-len", usage=True)


def fit_overlong(requests: list[Request], max_len: int, overlong: str) -> tuple[list[Request], int]:
    """The requests as the engine's length rule (``--overlong``, engine/lengths.py) runs them: an
    admitted request's output cut to what the rule lets it generate; a refused one left as it is
    (it is refused by its length). -> (requests, how many cut)."""
    out, cut = [], 0
    for r in requests:
        ok, olen = shape_one(r.prompt_len, r.output_len, max_len, overlong)
        if ok and olen != r.output_len:
            r = dataclasses.replace(r, output_len=olen)
            cut += 1
        out.append(r)
    return out, cut


def admitted_by_length(r: Request, max_len: int, overlong: str) -> bool:
    """Whether the length rule lets request ``r`` (as fit_overlong shaped it) run at all."""
    return shape_one(r.prompt_len, r.output_len, max_len, overlong)[0]


def check_trace_fits(requests: list[Request], cfg: ReplayConfig, num_blocks: int, max_len: int,
                     trace_path: str, kv_layout: KVLayout | None = None) -> None:
    """check_fits for every request a run of ``cfg`` admits (the first ``--limit`` of them)."""
    reqs = requests if cfg.limit is None else requests[:cfg.limit]
    reqs, _ = fit_overlong(reqs, max_len, cfg.overlong)
    reserve = slab_reserve_tokens(reqs, cfg, max_len)
    for r in reqs:
        if admitted_by_length(r, max_len, cfg.overlong):
            check_fits(r, cfg, num_blocks, reserve, trace_path, kv_layout, max_len)
