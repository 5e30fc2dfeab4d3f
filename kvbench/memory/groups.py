"""KV cache groups: a model's layers grouped by KV spec, as vLLM's hybrid KV cache manager groups them
(``vllm/v1/core/kv_cache_planning.py``), and what a pool of them costs.

Every group draws its blocks from one shared pool and keeps its own block table per sequence; a block
id is a slot in every group's tensors, so one block costs the page of one layer times the layers of
the largest group (``KVLayout.bytes_per_block``, vLLM's ``_get_kv_cache_bytes_per_block`` for a
layer-outer layout).

Grouping (``get_kv_cache_groups``): layers of one spec are one group when every layer has the same
spec (a plain or an MLA model: the single-group engine); otherwise the hybrid grouping
(``_get_kv_cache_groups_uniform_page_size``): layers bucketed by spec in order of first appearance,
a group size of the smallest bucket (of the largest when it is under 1.5 times the smallest), each
bucket split into cdiv(len, size) groups by striding (group i takes layers i, i + n, ...).
``disable_hybrid`` is vLLM's ``--disable-hybrid-kv-cache-manager``: every sliding or chunked layer is
allocated as full attention (``unify_hybrid_kv_cache_specs``), one group, the compute still windowed.

Mamba and linear-attention layers (a ``mamba`` LayerKV: one recurrent state per sequence) share the pool
as vLLM 0.34 shares it (``Platform._align_hybrid_block_size``): the block size is raised until one
attention page holds a state (``align_block_size``: whatever ``--block-size`` asked), and the state's
page is padded to the attention page, so every page is equal and the grouping above applies.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import lcm

import numpy as np

from kvbench.memory.specs import LayerKV


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers that share one block table per sequence: ``spec`` is each one's KV on a rank."""

    spec: LayerKV
    layers: tuple[int, ...]  # the model's layer indices, in order

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def window(self) -> int:
        return self.spec.window

    def skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens the next token no longer attends to (vLLM ``get_num_skipped_tokens``):
        sliding, the token at position n sees n - W + 1 .. n; chunked, its own chunk; else none."""
        if self.kind == "sliding":
            return max(0, num_computed - self.window + 1)
        if self.kind == "chunked":
            return num_computed // self.window * self.window
        if self.kind == "mamba":  # only the state after the last token (MambaManager)
            return max(0, num_computed - 1)
        return 0

    def admission_cap(self, block_size: int, in_flight_tokens: int, max_model_len: int) -> int | None:
        """The most blocks a windowed group counts at admission (vLLM
        ``max_admission_blocks_per_request``): the window and a step's tokens in flight (+1: the window
        may start mid-block); None for a group that keeps every token."""
        if self.kind == "sliding":
            return cdiv(min(self.window - 1 + in_flight_tokens, max_model_len), block_size) + 1
        if self.kind == "chunked":
            return cdiv(min(self.window + in_flight_tokens, max_model_len), block_size)
        return None

    def slab_tokens(self, reserve):
        """The slots a slab reserves for this group's layers (an int or an int array): every token up to
        ``reserve``, or a window's (a ring of its W slots) or a chunk's; a recurrent state one block."""
        if self.kind == "mamba":
            return np.minimum(reserve, 1)
        return reserve if self.kind not in ("sliding", "chunked") else np.minimum(reserve, self.window)

    def describe(self) -> str:
        return f"{self.spec.describe()} x {len(self.layers)}"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The groups of a model at one block size (tokens per block, every group's)."""

    groups: tuple[KVGroup, ...]
    block_size: int
    hybrid_disabled: bool = False
    asked_block_size: int = 0  # the block size asked for, when the recurrent state made it larger (align_block_size)

    @property
    def is_hybrid(self) -> bool:
        """More than one group, or a window: the hybrid KV cache manager's rules (kvbench.memory.hybrid);
        one group of full attention or MLA is the plain engine (kvbench.memory.paged)."""
        return len(self.groups) > 1 or self.groups[0].kind in ("sliding", "chunked")

    @property
    def has_state(self) -> bool:
        """Some group keeps a recurrent state per sequence (Mamba, linear attention)."""
        return any(g.kind == "mamba" for g in self.groups)

    @property
    def page_bytes(self) -> int:
        """One layer's block: every group's page, a recurrent state's padded to the attention page."""
        return max(g.spec.page_bytes(self.block_size) for g in self.groups)

    @property
    def state_padding(self) -> float:
        """The share of a state's page left empty by the padding (0 without recurrent layers)."""
        states = [g.spec.state_bytes for g in self.groups if g.kind == "mamba"]
        return self.page_bytes / max(states) - 1 if states else 0.0

    @property
    def bytes_per_block(self) -> int:
        """What one block of the shared pool costs: a page for each layer of the largest group."""
        return self.page_bytes * max(len(g.layers) for g in self.groups)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes a token takes in every group at once (the layers' sum, as full attention holds it)."""
        return sum(g.spec.bytes_per_token * len(g.layers) for g in self.groups)

    def layer_groups(self) -> list[int]:
        """Per layer of the model, the index of its group (whose block table the layer reads)."""
        out = [0] * sum(len(g.layers) for g in self.groups)
        for i, g in enumerate(self.groups):
            for layer in g.layers:
                out[layer] = i
        return out

    def peak_blocks(self, tokens, in_flight_tokens: int, max_model_len: int):
        """The most blocks a sequence of ``tokens`` tokens (an int or an int array) holds at once over
        every group: all its blocks in a group that keeps every token, at most the admission cap in a
        windowed one (its window and a step in flight)."""
        bs = self.block_size
        blocks = -(-tokens // bs)
        total = 0
        for g in self.groups:
            if g.kind == "mamba":  # the state, the one it is copied from, a checkpoint (MambaManager)
                total = total + np.minimum(blocks, 3 if g.spec.checkpoints else 2)
                continue
            cap = g.admission_cap(bs, in_flight_tokens, max_model_len)
            total = total + (blocks if cap is None else np.minimum(blocks, cap))
        return total

    def slab_blocks(self, reserve):
        """The blocks of a slab of ``reserve`` tokens (an int or an int array): each group's slots
        (KVGroup.slab_tokens) in whole blocks, summed."""
        bs = self.block_size
        return sum(-(-g.slab_tokens(reserve) // bs) for g in self.groups)

    def slab_live(self, num_tokens: int) -> int:
        """The slots of a slab that ``num_tokens`` tokens fill, over every group (a recurrent state fills its
        block, as the paged layout counts it)."""
        return int(sum(self.block_size if g.kind == "mamba" and num_tokens > 0 else g.slab_tokens(num_tokens)
                       for g in self.groups))

    def num_blocks(self, kv_bytes: int) -> int:
        """Blocks a pool of ``kv_bytes`` holds (vLLM: available memory // bytes per block, the null
        block among them)."""
        return kv_bytes // self.bytes_per_block

    def describe(self) -> str:
        """'sliding 128 x 18, full x 18 (589,824 B a block)'; with recurrent layers the block size
        too, and why it is not the one asked for."""
        runs: list[list] = []  # equal groups in a row, as one: '3 x (mamba x 12)'
        for g in self.groups:
            if runs and runs[-1][0] == g.describe():
                runs[-1][1] += 1
            else:
                runs.append([g.describe(), 1])
        text = ", ".join(d if n == 1 else f"{n} x ({d})" for d, n in runs) + f" ({self.bytes_per_block:,} B a block)"
        if self.has_state:
            text += f", block {self.block_size} tokens{self.block_size_reason()}"
        return text

    def block_size_reason(self) -> str:
        """Why the block size is not the one asked for ('' when it is)."""
        if not self.asked_block_size or self.asked_block_size == self.block_size:
            return ""
        return (f" (not {self.asked_block_size}: vLLM raises the block size until an attention page holds a "
                f"recurrent state, {self.state_padding:.1%} of the state's page then padding)")

    def to_dict(self) -> dict:
        return {"groups": [{"kind": g.kind, "window": g.window or None, "layers": len(g.layers),
                            "bytes_per_token": g.spec.bytes_per_token * len(g.layers),
                            "page_bytes": self.page_bytes if g.kind == "mamba" else g.spec.page_bytes(self.block_size),
                            # a sequence's recurrent state over the group's layers (as bytes_per_token is)
                            **({"state_bytes": g.spec.state_bytes * len(g.layers)} if g.kind == "mamba" else {})}
                           for g in self.groups],
                "bytes_per_block": self.bytes_per_block, "hybrid_disabled": self.hybrid_disabled,
                "block_size": self.block_size, "asked_block_size": self.asked_block_size or self.block_size}


KERNEL_BLOCK = 16  # FlashAttention's smallest kernel block (its supported sizes: MultipleOf(16))
GDN_CHECKPOINT_ALIGNMENT = 64  # FlashInfer's GDN prefill exports states every 64 tokens (gdn_attn.py)


def align_block_size(layers: list[LayerKV], block_size: int) -> int:
    """The block size vLLM 0.34 runs a model with recurrent layers at (``Platform._align_hybrid_block_size``):
    the smallest multiple of the kernel alignment whose attention page holds the largest state, the
    alignment being the block size asked (at least the kernel's 16 tokens), made a multiple of 64 when
    the prefill exports checkpoints; never below the size asked. Unchanged without recurrent layers."""
    states = [s for s in layers if s.kind == "mamba"]
    if not states:
        return block_size
    per_token = {s.bytes_per_token for s in layers if s.kind != "mamba"}
    if not per_token:
        raise ValueError("a model of recurrent layers only (no attention layer) is not modelled")
    if len(per_token) > 1:
        raise ValueError("recurrent layers beside attention layers of different KV sizes are not modelled")
    token = per_token.pop()
    align = max(KERNEL_BLOCK, block_size)
    if any(s.checkpoints for s in states):
        align = lcm(align, GDN_CHECKPOINT_ALIGNMENT)
    size = align * cdiv(max(s.state_bytes for s in states), align * token)
    return max(block_size, KERNEL_BLOCK * cdiv(size, KERNEL_BLOCK))


def group_layers(layers: list[LayerKV], block_size: int, disable_hybrid: bool = False) -> KVLayout:
    """The KV cache groups of a model's layers (vLLM ``get_kv_cache_groups``), at the block size vLLM
    runs them at (``align_block_size``)."""
    if not layers:
        raise ValueError("a model with no attention layer has no KV cache")
    asked = block_size
    if any(s.kind == "mamba" for s in layers):
        if disable_hybrid:
            raise ValueError("a model with recurrent (Mamba, linear-attention) layers cannot run with the hybrid KV "
                             "cache manager off: vLLM keeps their state as a KV cache group of its own")
        block_size = align_block_size(layers, block_size)
        page = block_size * next(s.bytes_per_token for s in layers if s.kind != "mamba")
        pages = {page}
    else:
        pages = set()
    if disable_hybrid and any(s.kind == "full" for s in layers):  # unify_hybrid_kv_cache_specs
        layers = [replace(s, kind="full", window=0) if s.kind in ("sliding", "chunked") else s for s in layers]
    pages |= {s.page_bytes(block_size) for s in layers if s.kind != "mamba"}
    if len(pages) > 1:
        raise ValueError(f"layers with different page sizes ({', '.join(f'{p:,}' for p in sorted(pages))} B at "
                         f"block {block_size}) are not modelled (vLLM pads or enlarges their blocks)")
    buckets: dict[LayerKV, list[int]] = {}
    for i, s in enumerate(layers):
        buckets.setdefault(s, []).append(i)
    if len(buckets) == 1:
        spec, ids = next(iter(buckets.items()))
        return KVLayout((KVGroup(spec, tuple(ids)),), block_size, disable_hybrid, asked)
    sizes = [len(ids) for ids in buckets.values()]
    size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    groups: list[KVGroup] = []
    for spec, ids in buckets.items():
        n = cdiv(len(ids), size)
        groups.extend(KVGroup(spec, tuple(ids[i::n])) for i in range(n))
    return KVLayout(tuple(groups), block_size, disable_hybrid, asked)


__all__ = ["KVGroup", "KVLayout", "align_block_size", "cdiv", "group_layers"]
