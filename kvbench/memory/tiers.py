"""Prefix-cache tiers behind the GPU pool: host DRAM (``cpu``) and local NVMe (``disk``), as vLLM's
KV offloading connector, LMCache, SGLang's HiCache and Mooncake Store put them behind the GPU, and a
``store`` shared by every instance of a run (Mooncake Store, LMCache's remote backend): one ``Tier``
object at the end of every instance's chain, written through by each, its blocks found by lookups
only from ``delay`` seconds after the step that wrote them ended (``Tier.settle``).

A ``Tier`` holds whole blocks under their chained prefix keys, ordered by a kvbench.memory.policies
class; ``Tiers`` is one chain per replica, called by PagedKV: lookup along the chain (``match``),
write-through or write-back stores, ``--load-policy``, and the transfer ops handed to the executor
(``take_ops``). The rules: docs/architecture.md, "Layer 2, memory" ("Prefix-cache tiers").
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from kvbench.memory.policies import LRUPolicy, make_policy
from kvbench.memory.policy_base import NEVER, CacheView

TIER_NAMES = ("cpu", "disk", "store")  # in lookup order: an instance's own tiers, then the shared store
OFFLOADS = ("write-through", "write-back")
LOAD_POLICIES = ("always", "auto")
# Effective bandwidths per direction when none is given (bytes/s): PCIe Gen5 x16 host<->GPU, and one
# datacenter NVMe drive's sequential read/write.
DEFAULT_BW = {"cpu": 50e9, "disk": 7e9}


@dataclass(slots=True)
class TierSpec:
    """One tier's settings: ``capacity`` in blocks (0: absent), bandwidth in bytes/s, cache policy."""

    name: str
    capacity: int
    bandwidth: float
    policy: str = "lru"


class _TierView(CacheView):
    """Keys and parents of a tier's slots, for policies that read them (arc, s3fifo, prefix)."""

    def __init__(self, tier: "Tier"):
        self._tier = tier

    def key_of(self, block: int):
        return self._tier.key[block]

    def parent_of(self, block: int) -> int:
        t = self._tier
        return t.slot_of.get(t.parent[block], -1)


class Tier:
    """One tier's blocks: key -> slot, each slot's key and parent key, the policy over the slots."""

    def __init__(self, spec: TierSpec, physical: int | None = None):
        """``physical``: the most slots the run can fill (a tier larger than every block of the trace
        needs no more state)."""
        self.name, self.bandwidth = spec.name, spec.bandwidth
        self.capacity = spec.capacity
        n = spec.capacity if physical is None else max(1, min(spec.capacity, physical))
        self.slots = n
        self.policy = make_policy(spec.policy, n, n)
        self.policy.bind(_TierView(self))
        self._lru = type(self.policy) is LRUPolicy  # store_run's batch path
        self.slot_of: dict[int, int] = {}
        self.key: list[int | None] = [None] * n
        self.parent: list[int] = [0] * n
        self._next = 0  # slots never used yet: [_next, n)
        self.pins: dict[int, int] = {}  # slot -> loads of this step reading it
        self.clock: float = 0
        # a shared store's visibility: slots written in the step under way (settle), the time from which
        # each slot may be found, and the latest such time (a lookup after it finds every slot); None: a
        # tier of one instance, whose blocks are found at once
        self.delay: float | None = None
        self.fresh: list[int] = []
        self.visible_at: list[float] | None = None
        self.settled = -math.inf  # when the latest settled write becomes visible
        # counters
        self.stored_blocks = 0
        self.loaded_blocks = 0
        self.evicted_blocks = 0
        self.dropped_stores = 0  # stores refused: every slot pinned

    def __len__(self) -> int:
        return len(self.slot_of)

    def pin(self, slot: int, next_use: int = NEVER) -> None:
        """A load reads the slot this step: a use, and not evictable until ``unpin_all``."""
        c = self.pins.get(slot, 0)
        if not c:
            self.policy.reuse(slot)
        self.policy.on_use(slot, self.clock, next_use)
        self.pins[slot] = c + 1
        self.loaded_blocks += 1

    def unpin_all(self) -> None:
        if self.pins:  # last pinned first, so a loaded prefix ends up more recent than its continuation
            self.policy.release_many(list(self.pins)[::-1])
            self.pins.clear()

    def share(self, delay_s: float) -> "Tier":
        """Make this the run's shared store: what an instance writes is found ``delay_s`` after the
        step that wrote it ends."""
        self.delay = delay_s
        self.visible_at = [-math.inf] * self.slots
        return self

    def settle(self, end_s: float) -> None:
        """The step that wrote ``fresh`` ended at ``end_s``: its blocks are found from ``end_s + delay``."""
        if self.fresh:
            t = end_s + (self.delay or 0.0)
            at = self.visible_at
            assert at is not None  # (a shared store's)
            for s in self.fresh:
                at[s] = t
            self.fresh.clear()
            self.settled = max(self.settled, t)

    def hidden(self, now: float) -> bool:
        """Whether a lookup at ``now`` may miss a block this tier holds (a shared store's recent writes)."""
        return bool(self.fresh) or now < self.settled

    def visible(self, slot: int, now: float) -> bool:
        """Whether a lookup at ``now`` finds the block in ``slot`` (a shared store's writes appear late)."""
        return self.visible_at is None or self.visible_at[slot] <= now

    def prefix(self, keys, parent: int, now: float) -> int:
        """How many leading ``keys`` (chained from ``parent``) a lookup at ``now`` finds here."""
        slot_of, parent_of, n = self.slot_of, self.parent, 0
        hidden = self.hidden(now)
        for k in keys:
            s = slot_of.get(k)
            if s is None or parent_of[s] != parent or (hidden and not self.visible(s, now)):
                break
            n += 1
            parent = k
        return n

    def _written(self, slots) -> None:
        """A shared store's new blocks are hidden until their step ends (``settle``)."""
        at = self.visible_at
        if at is not None:
            for s in slots:
                if s >= 0:
                    at[s] = math.inf
                    self.fresh.append(s)

    def store_run(self, keys: list[int], parents: list[int], next_uses=None) -> list[int]:
        """``store`` each key in order (write-through's run of computed blocks); the slots stored
        into, -1 where nothing was. An lru tier takes a run of new keys in one batch."""
        slots = self._store_new_lru(keys, parents) if self._lru else None
        if slots is None:
            store = self.store
            slots = [store(k, p, NEVER if next_uses is None else next_uses[j])[0]
                     for j, (k, p) in enumerate(zip(keys, parents))]
        self._written(slots)
        return slots

    def _store_new_lru(self, keys: list[int], parents: list[int]) -> list[int] | None:
        """``store_run`` when the policy is lru and no key of the run is held yet (computed blocks
        usually are new): the victims popped at once from the least recent end, which is what popping
        them one by one gives as long as the tier holds more evictable blocks than the run needs (each
        new block goes to the most recent end). None where that does not hold: the general loop."""
        slot_of, policy = self.slot_of, self.policy
        if any(k in slot_of for k in keys) or len(set(keys)) < len(keys):
            return None
        free = min(len(keys), self.slots - self._next)
        rest = len(keys) - free
        if rest > len(policy):
            return None
        slots = list(range(self._next, self._next + free))
        self._next += free
        if rest:
            held = cast("list[int]", self.key)  # victims are stored slots: each holds its key
            victims = policy.pop_many(rest)
            for v in victims:
                del slot_of[held[v]]
            self.evicted_blocks += rest
            slots += victims
        key_of, parent_of = self.key, self.parent
        for sl, k, p in zip(slots, keys, parents):
            slot_of[k] = sl
            key_of[sl] = k
            parent_of[sl] = p
        policy.release_many(slots)  # lru's on_insert does nothing: order is release order
        self.stored_blocks += len(keys)
        return slots

    def store(self, key: int, parent: int, next_use: int = NEVER) -> tuple[int, int | None, int | None]:
        """Put ``key`` in the tier. Returns (slot, victim key, victim parent), the victim's key None
        when no block was evicted for it; slot -1 when nothing is stored: the key is held already
        (a use of its slot) or every slot is pinned."""
        s = self.slot_of.get(key, -1)
        if s >= 0:
            if s not in self.pins:
                self.policy.reuse(s)
                self.policy.on_use(s, self.clock, next_use)
                self.policy.release(s)
            return -1, None, None
        vkey = vparent = None
        if self._next < self.slots:
            s = self._next
            self._next += 1
        elif len(self.policy):
            s = self.policy.pop()
            vkey, vparent = self.key[s], self.parent[s]
            del self.slot_of[vkey]  # type: ignore[arg-type]  # a stored slot holds its key
            self.evicted_blocks += 1
        else:
            self.dropped_stores += 1
            return -1, None, None
        self.slot_of[key] = s
        self.key[s], self.parent[s] = key, parent
        self.policy.on_insert(s, self.clock, next_use)
        self.policy.release(s)
        self.stored_blocks += 1
        return s, vkey, vparent


@dataclass(slots=True)
class TierMatch:
    """A lookup's run of tier hits after the GPU pool's: per block, the tier (index) and slot."""

    tiers: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    declined: int = 0  # blocks found but not worth loading (auto): recomputed if the request is admitted

    def __len__(self) -> int:
        return len(self.slots)


class Tiers:
    """The chain of tiers behind one GPU pool (``TIER_NAMES`` order, absent tiers left out)."""

    def __init__(self, specs: list[TierSpec], offload: str = "write-through", load_policy: str = "auto",
                 block_bytes: int = 0, physical: int | None = None, store: Tier | None = None,
                 reads_store: bool = True):
        """``store``: the run's shared store (``Tier.share``), after this pool's own tiers; every
        instance writes its computed blocks through to it whatever ``offload`` says; an instance with
        ``reads_store`` False (a decode instance, which loads prompts from its prefill instance) only
        writes."""
        if offload not in OFFLOADS:
            raise ValueError(f"unknown offload {offload!r} (choose from {', '.join(OFFLOADS)})")
        if load_policy not in LOAD_POLICIES:
            raise ValueError(f"unknown load policy {load_policy!r} (choose from {', '.join(LOAD_POLICIES)})")
        self.tiers = [Tier(s, physical) for s in specs if s.capacity > 0]
        self.own = len(self.tiers)  # tiers[:own] are this pool's; a shared store after them
        if store is not None:
            self.tiers.append(store)
        self.readable = self.tiers if store is None or reads_store else self.tiers[:self.own]
        self.names = [t.name for t in self.tiers]
        self.write_through = offload == "write-through"
        self.stores = self.write_through or store is not None  # computed blocks go somewhere (PagedKV)
        self.auto = load_policy == "auto"
        self.block_bytes = block_bytes
        # seconds to prefill n tokens after `start` cached ones (the executor's): auto's yardstick
        self.recompute_s: Callable[[int, int, int], float] | None = None
        self.pre: list[tuple] = []  # ops before the forward, in issue order
        self.post: list[tuple] = []  # write-through stores after the forward
        self.declined_tokens = 0  # auto: tier hits recomputed because loading was slower
        self.clock: float = 0

    def __bool__(self) -> bool:
        return bool(self.tiers)

    # -- lookup --------------------------------------------------------------------------------
    def match(self, keys: list[int], start: int, n_max: int, parent: int, block_size: int,
              prompt_tokens: int = 0) -> TierMatch:
        """The tier hits continuing a GPU match of ``start`` blocks, up to ``n_max`` blocks in all,
        then (``auto``) cut to the prefix worth loading for a prompt of ``prompt_tokens``."""
        m = TierMatch()
        found_tiers, found_slots = m.tiers, m.slots
        readable = self.readable
        now = self.clock
        if len(readable) == 1 and not readable[0].hidden(now):  # one tier: its slots looked up in C, the chain checked after
            t = readable[0]
            parent_of = t.parent
            for k, s in zip(keys[start:n_max], map(t.slot_of.get, keys[start:n_max])):
                if s is None or parent_of[s] != parent:
                    break
                found_slots.append(s)
                parent = k
            found_tiers.extend([0] * len(found_slots))
            return self._cut(m, start, block_size, prompt_tokens)
        # (index, a slot, its chain, the tier where a block it holds may not be found yet); a store the
        # pool only writes is left out
        held = [(i, t.slot_of.get, t.parent, t if t.hidden(now) else None) for i, t in enumerate(readable)]
        for j in range(start, n_max):
            k = keys[j]
            for i, get, parent_of, late in held:
                s = get(k)
                if s is not None and parent_of[s] == parent and (late is None or late.visible(s, now)):
                    found_tiers.append(i)
                    found_slots.append(s)
                    break
            else:
                break
            parent = k
        return self._cut(m, start, block_size, prompt_tokens)

    def _cut(self, m: TierMatch, start: int, block_size: int, prompt_tokens: int) -> TierMatch:
        if m.slots and self.auto and self.recompute_s is not None:
            keep = self._worth(m, start * block_size, block_size, prompt_tokens)
            if keep < len(m):
                m.declined = len(m) - keep
                del m.tiers[keep:], m.slots[keep:]
        return m

    def _worth(self, m: TierMatch, start_tokens: int, bs: int, prompt_tokens: int) -> int:
        """How many of the run's blocks to load: of the prefixes ending where the tier changes or at
        the run's end, the one that saves the most (recompute minus load) seconds; 0 if none saves."""
        recompute_s = self.recompute_s
        assert recompute_s is not None  # (_cut weighs a run only then)
        best, best_gain = 0, 0.0
        load = 0.0
        n = len(m)
        for j in range(n):
            load += self.block_bytes / self.tiers[m.tiers[j]].bandwidth
            if j + 1 == n or m.tiers[j + 1] != m.tiers[j]:
                k = (j + 1) * bs
                gain = recompute_s(start_tokens, k, max(0, prompt_tokens - start_tokens - k)) - load
                if gain > best_gain:
                    best, best_gain = j + 1, gain
        return best

    # -- moves -----------------------------------------------------------------------------------
    def pin(self, m: TierMatch, next_uses=None) -> None:
        """A match is being loaded: its slots are used and stay put until ``take_ops``."""
        tiers = self.tiers
        for j, (i, s) in enumerate(zip(m.tiers, m.slots)):
            t = tiers[i]
            t.clock = self.clock
            t.pin(s, NEVER if next_uses is None or j >= len(next_uses) else int(next_uses[j]))

    def loads(self, m: TierMatch, blocks: list[int]) -> None:
        """The pinned match goes into GPU blocks ``blocks`` (fresh, in order) before the forward."""
        names = self.names
        self.pre.extend((names[i], s, "gpu", b) for i, s, b in zip(m.tiers, m.slots, blocks))

    def stored(self, blocks: list[int], keys: list[int], parents: list[int], next_uses=None) -> None:
        """Write-through: blocks the GPU pool just registered (computed this step) go to every tier."""
        if not self.stores:
            return
        # tail first: a prefix ends up more recent than its continuation, and outlives it
        blocks, keys, parents = blocks[::-1], keys[::-1], parents[::-1]
        nus = None if next_uses is None else [int(x) for x in next_uses[::-1]]
        post = self.post
        for t in self.tiers if self.write_through else self.tiers[self.own:]:
            t.clock = self.clock
            name = t.name
            post.extend(("gpu", b, name, s) for b, s in zip(blocks, t.store_run(keys, parents, nus)) if s >= 0)

    def evicted(self, blocks: list[int], keys: list[int], parents: list[int]) -> None:
        """Write-back: blocks the GPU pool evicts go to the first tier (their GPU block is reused
        after this step's pre ops), and each tier's victims to the next."""
        if self.write_through:
            return
        for b, k, p in zip(blocks, keys, parents):
            self._write_back(0, "gpu", b, k, p)

    def _write_back(self, i: int, src: str, index: int, key: int, parent: int) -> None:
        while i < self.own:  # (the shared store is written through, never demoted into)
            t = self.tiers[i]
            t.clock = self.clock
            s, vkey, vparent = t.store(key, parent)
            if s >= 0:
                if vkey is not None and i + 1 < self.own:
                    # the victim leaves for the next tier before the new block takes its slot
                    assert vparent is not None  # (a victim has both)
                    self._write_back(i + 1, t.name, s, vkey, vparent)
                self.pre.append((src, index, t.name, s))
            return

    def take_ops(self) -> tuple[list[tuple], list[tuple]]:
        """The step's (pre, post) ops for the executor; unpins the slots loads read."""
        pre, post = self.pre, self.post
        self.pre, self.post = [], []
        for t in self.tiers:
            t.unpin_all()
        return pre, post


def op_bytes(ops: list[tuple], block_bytes: int) -> dict[str, list[int]]:
    """Per tier name: [bytes loaded from it into the GPU, bytes stored into it] by ``ops``."""
    out: dict[str, list[int]] = {}
    for src, _, dst, _ in ops:
        if dst == "gpu":
            out.setdefault(src, [0, 0])[0] += block_bytes
        else:
            out.setdefault(dst, [0, 0])[1] += block_bytes
    return out


def op_seconds(ops: list[tuple], block_bytes: int, bandwidth: dict[str, float]) -> float:
    """Seconds ``ops`` take one after another, each at the slower end's bandwidth (the GPU's is
    never the slower)."""
    total = 0.0
    for src, _, dst, _ in ops:
        bw = min(bandwidth.get(src, float("inf")), bandwidth.get(dst, float("inf")))
        total += block_bytes / bw
    return total
