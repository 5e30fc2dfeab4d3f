"""Layer 2, KV memory: the contracts (contracts: KVManager, BlockPoolAPI, SeqKV), block pool and prefix
index (block_pool; its compiled twin array_pool over compiled), cache policies (policies), paged block
tables (paged), radix partial matching and node eviction (radix), the slab baseline (slab), belady's
future (future), the prefix-cache tiers (tiers), KV specs and cache groups (specs, groups) and the
hybrid layout of a model with several groups (hybrid)."""
from kvbench.memory.block_pool import BlockPool
from kvbench.memory.contracts import BlockPoolAPI, KVManager, KVStats, SeqKV
from kvbench.memory.groups import KVGroup, KVLayout, group_layers
from kvbench.memory.hybrid import HybridKV
from kvbench.memory.paged import RADIX_EVICTIONS, PagedKV
from kvbench.memory.policies import CACHE_POLICIES, make_policy
from kvbench.memory.slab import SlabKV

LAYOUTS: dict[str, type[PagedKV] | type[SlabKV]] = {"paged": PagedKV, "slab": SlabKV}


def make_kv(layout: str, num_blocks: int, block_size: int, *, prefix_cache: bool = True,
            cache_policy: str = "lru", prefix_mode: str = "hash", radix_eviction: str = "node",
            physical: int | None = None, kv_layout: KVLayout | None = None, max_batched_tokens: int = 8192,
            max_model_len: int = 1 << 30) -> KVManager:
    """The KV manager for a layout name (``--layout``). ``physical``: the most blocks the run can
    use, when known (a paged pool holds state for no more; see BlockPool). ``kv_layout``: the model's
    KV cache groups; a hybrid one (several groups, or a window) runs on HybridKV, which sizes its
    windowed groups' admission caps by ``max_batched_tokens`` and ``max_model_len``."""
    if layout == "paged" and kv_layout is not None and kv_layout.is_hybrid:
        return HybridKV(num_blocks, kv_layout, prefix_cache=prefix_cache, cache_policy=cache_policy,
                        max_batched_tokens=max_batched_tokens, max_model_len=max_model_len)
    try:
        cls = LAYOUTS[layout]
    except KeyError:
        raise ValueError(f"unknown layout {layout!r} (choose from {', '.join(LAYOUTS)})") from None
    if cls is SlabKV:
        return SlabKV(num_blocks, block_size, kv_layout=kv_layout)
    return cls(num_blocks, block_size, prefix_cache=prefix_cache, cache_policy=cache_policy,
               prefix_mode=prefix_mode, radix_eviction=radix_eviction, physical=physical)


__all__ = ["CACHE_POLICIES", "LAYOUTS", "RADIX_EVICTIONS", "BlockPool", "BlockPoolAPI", "HybridKV", "KVGroup",
           "KVLayout", "KVManager", "KVStats", "PagedKV", "SeqKV", "SlabKV", "group_layers", "make_kv", "make_policy"]
