"""KV cache specs: what one layer keeps per token, as vLLM's KVCacheSpec does
(``vllm/v1/kv_cache_interface.py``). A model is a list of these, one per layer; the memory layer
groups them (kvbench.memory.groups) and the executors read their bytes.

Kinds: ``full`` (every token, vLLM's FullAttentionSpec), ``sliding`` (the last ``window`` tokens,
SlidingWindowSpec), ``chunked`` (the tokens of the current ``window``-token chunk,
ChunkedLocalAttentionSpec), ``mla`` (one latent "head" of kv_lora_rank + qk_rope_head_dim values a
token, no separate K and V: MLAAttentionSpec), ``mamba`` (a Mamba or linear-attention layer: no KV per
token but one recurrent state per sequence, conv and SSM state together, ``state_bytes`` on a rank:
vLLM's MambaSpec, whose page is that state whatever the block size).
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("full", "sliding", "chunked", "mla", "mamba")


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One attention layer's KV cache on one tensor-parallel rank."""

    kind: str
    num_kv_heads: int  # on this rank (mla: 1, the latent is held whole on every rank)
    head_size: int  # values per head (mla: kv_lora_rank + qk_rope_head_dim)
    dtype_bytes: int  # of one cached value (bf16: 2, fp8: 1)
    window: int = 0  # sliding: tokens a query sees, itself included; chunked: the chunk's tokens
    state_bytes: int = 0  # mamba: the recurrent state of one sequence (vLLM MambaSpec.page_size_bytes, unpadded)
    checkpoints: bool = False  # mamba: the prefill exports its state at the last block boundary itself
    # (vLLM: a Gated DeltaNet layer on Hopper, FlashInfer's GDN prefill: num_prefill_checkpoint_blocks = 1)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV spec kind {self.kind!r} (choose from {', '.join(KINDS)})")
        if min(self.num_kv_heads, self.head_size, self.dtype_bytes) < 1:
            raise ValueError(f"a {self.kind} layer needs heads, head size and dtype bytes >= 1")
        if (self.kind in ("sliding", "chunked")) != (self.window > 0):
            raise ValueError(f"a {self.kind} layer {'needs' if self.window <= 0 else 'takes no'} window")
        if (self.kind == "mamba") != (self.state_bytes > 0) or (self.checkpoints and self.kind != "mamba"):
            raise ValueError(f"a {self.kind} layer {'needs' if self.kind == 'mamba' else 'takes no'} recurrent state")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token (mla: the latent, once; mamba: none, its state is per sequence)."""
        if self.kind == "mamba":
            return 0
        kv = 1 if self.kind == "mla" else 2
        return kv * self.num_kv_heads * self.head_size * self.dtype_bytes

    def page_bytes(self, block_size: int) -> int:
        """One block of this layer (vLLM: AttentionSpec.page_size_bytes; a mamba layer's is its state,
        MambaSpec.page_size_bytes, before the grouping pads it to the attention page)."""
        if self.kind == "mamba":
            return self.state_bytes
        return block_size * self.bytes_per_token

    def describe(self) -> str:
        w = f" {self.window}" if self.window else ""
        return f"{self.kind}{w}"


__all__ = ["KINDS", "LayerKV"]
