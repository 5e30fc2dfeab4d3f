"""Request routing across replicas (``--replicas N --router NAME``).

Every replica is a whole engine (pool, scheduler, executor); the router sees each request once, at its
arrival, and picks the replica that serves it. What a router may look at is what a real one sees:

- ``round-robin``: nothing (arrival order).
- ``least-loaded``: each replica's reported load, the sequences waiting and running there (ties: the
  replica with more free blocks, then the lower index), as vLLM's and SGLang's load-balancing routers.
- ``session``: the trace's ``session`` hashed to a replica (sticky); a request without one goes to the
  least-loaded replica.
- ``prefix``: consistent hashing (a ring of virtual nodes per replica) of the prompt's first
  ``--router-prefix-blocks`` block keys, so requests that start alike meet on one replica whatever the
  number of replicas; a prompt shorter than one block goes to the least-loaded replica.
- ``kv-aware``: NVIDIA Dynamo's KV router cost (docs/router/kv_cache_routing.md, "cost function"):
  ``cost = cache_weight x blocks to prefill + load_weight x active blocks``, lowest cost wins (ties: the
  lower index). Blocks to prefill are the prompt's blocks minus the longest prefix the router believes
  the replica caches; active blocks are the blocks the replica holds for its running sequences plus what
  its waiting prompts and this prompt will need. The router's belief is a per-replica index of block
  keys fed by the replicas' block-stored / block-evicted events (Dynamo's KvIndexer, llm-d's KV-event
  scorer) that become visible ``--router-event-delay`` engine seconds after the step that emitted
  them; it never reads a replica's pool. What it predicted and what hit are counted (summary
  ``router_mispredicted_blocks``).
- ``conductor``: Mooncake's Conductor (Qin et al., FAST '25, section 6, its Algorithm 1, "KVCache-centric
  scheduling"): for each instance, the time to the prompt's first token there is the instance's queue plus
  the prompt's prefill given the prefix the instance caches -- or, where loading is faster than computing,
  the longer prefix a shared store holds (``--store-kv-mem``), loaded at the store's rate -- and the
  instance with the smallest wins (ties: the lower index). What each instance caches is the kv-aware
  router's delayed-event index; prefill times are the executor's own cost model (``recompute_s``); the
  queue is the router's account of what it sent: each request it routes keeps its instance busy for its
  estimated prefill, after the work sent before it (``busy_until``), so an instance's queue is
  ``max(0, busy_until - now)``. It prices prefill only: meant for prefill instances (``--disagg``), where
  the paper uses it; over mixed replicas it ignores their decodes.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Callable
from itertools import count

import xxhash

ROUTERS = ("round-robin", "least-loaded", "session", "prefix", "kv-aware", "conductor")
VIRTUAL_NODES = 64  # ring points per replica (prefix router)


def _h64(data: bytes | str) -> int:
    return xxhash.xxh64_intdigest(data.encode() if isinstance(data, str) else data)


class KVIndex:
    """The router's view of which block keys each replica caches, from delayed events."""

    def __init__(self, replicas: int, delay_s: float):
        self.keys: list[set[int]] = [set() for _ in range(replicas)]
        self.delay_s = delay_s
        self._pending: list = []  # heap of (visible at, seq, replica, stored?, keys)
        self._seq = count()

    def publish(self, replica: int, t_s: float, events: list) -> None:
        """Events a replica emitted in a step that ended at ``t_s``: (stored?, keys) in order."""
        for stored, keys in events:
            heapq.heappush(self._pending, (t_s + self.delay_s, next(self._seq), replica, stored, keys))

    def advance(self, now_s: float) -> None:
        pending = self._pending
        while pending and pending[0][0] <= now_s:
            _, _, replica, stored, keys = heapq.heappop(pending)
            if stored:
                self.keys[replica].update(keys)
            else:
                self.keys[replica].difference_update(keys)

    def match(self, replica: int, keys) -> int:
        """How many leading block keys of a prompt the replica is believed to cache."""
        have = self.keys[replica]
        n = 0
        for k in keys:
            if k not in have:
                break
            n += 1
        return n


class Router:
    """Picks a replica for each arriving request. ``loads[i]``: (waiting + running sequences, free
    blocks, active blocks) of replica i as the replica reports them."""

    def __init__(self, name: str, replicas: int, *, prefix_blocks: int = 4, cache_weight: float = 1.0,
                 load_weight: float = 1.0, event_delay_s: float = 0.0, block_size: int = 16,
                 prefill_s: Callable[[int, int], float] | None = None,
                 store_match: Callable[[list, float], int] | None = None, store_block_s: float = 0.0):
        """``prefill_s(cached, new)``: seconds to prefill ``new`` tokens after ``cached`` ones (conductor);
        ``store_match(keys, now)``: leading blocks of a prompt a shared store holds, each loaded in
        ``store_block_s``."""
        if name not in ROUTERS:
            raise ValueError(f"unknown router {name!r}")
        self.name, self.n = name, replicas
        self.prefix_blocks = prefix_blocks
        self.cache_weight, self.load_weight = cache_weight, load_weight
        self.index = KVIndex(replicas, event_delay_s) if name in ("kv-aware", "conductor") else None
        if name == "conductor" and prefill_s is None:
            raise ValueError("the conductor router needs a prefill time (prefill_s)")
        self.block_size, self.prefill_s = block_size, prefill_s
        self.store_match, self.store_block_s = store_match, store_block_s
        self.busy_until = [0.0] * replicas  # conductor: when the prefills it sent each instance end
        self._next = 0
        if name == "prefix":
            points = sorted((_h64(f"replica-{i}-{v}"), i) for i in range(replicas) for v in range(VIRTUAL_NODES))
            self._ring = [p for p, _ in points]
            self._owner = [i for _, i in points]

    @staticmethod
    def least_loaded(loads) -> int:
        return min(range(len(loads)), key=lambda i: (loads[i][0], -loads[i][1], i))

    def route(self, now_s: float, session: str | None, keys, prompt_blocks: int, loads,
              prompt_tokens: int = 0) -> tuple[int, int]:
        """-> (replica, prompt blocks the router expects to hit there; 0 for routers without an index).
        ``keys``: the block keys a prompt of ``prompt_tokens`` tokens can hit."""
        if self.n == 1:
            return 0, self._expect(0, now_s, keys)
        name = self.name
        if name == "round-robin":
            i = self._next
            self._next = (i + 1) % self.n
            return i, 0
        if name == "least-loaded":
            return self.least_loaded(loads), 0
        if name == "session":
            if session is None:
                return self.least_loaded(loads), 0
            return _h64(session) % self.n, 0
        if name == "prefix":
            k = min(self.prefix_blocks, len(keys))
            if k == 0:
                return self.least_loaded(loads), 0
            pos = bisect_right(self._ring, _h64((int(keys[k - 1]) & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")))
            return self._owner[pos % len(self._ring)], 0
        if name == "conductor":
            return self._conductor(now_s, keys, prompt_tokens)
        # kv-aware
        index = self.index
        assert index is not None  # (kv-aware's)
        index.advance(now_s)
        best, best_cost, best_hit = 0, None, 0
        for i in range(self.n):
            hit = index.match(i, keys)
            cost = self.cache_weight * (prompt_blocks - hit) + self.load_weight * (loads[i][2] + prompt_blocks)
            if best_cost is None or cost < best_cost:
                best, best_cost, best_hit = i, cost, hit
        return best, best_hit

    def _conductor(self, now_s: float, keys, prompt_tokens: int) -> tuple[int, int]:
        """Mooncake's cache-and-load choice (the module's docstring): the smallest queue + prefill."""
        index, prefill_s, bs = self.index, self.prefill_s, self.block_size
        assert index is not None and prefill_s is not None  # (the conductor's)
        index.advance(now_s)
        stored = self.store_match(keys, now_s) if self.store_match is not None else 0
        busy = self.busy_until
        best, best_t, best_hit, best_work = 0, math.inf, 0, 0.0
        for i in range(self.n):
            hit = index.match(i, keys)
            cached = min(hit * bs, prompt_tokens)
            work = prefill_s(cached, prompt_tokens - cached)
            if stored > hit:  # load the store's longer prefix, where that is faster than computing it
                more = min(stored * bs, prompt_tokens) - cached
                with_load = (stored - hit) * self.store_block_s + prefill_s(cached + more, prompt_tokens - cached - more)
                if with_load < work:
                    work, hit = with_load, stored
            t = max(0.0, busy[i] - now_s) + work
            if t < best_t:
                best, best_t, best_hit, best_work = i, t, hit, work
        busy[best] = max(busy[best], now_s) + best_work
        return best, best_hit

    def _expect(self, replica: int, now_s: float, keys) -> int:
        if self.index is None:
            return 0
        self.index.advance(now_s)
        return self.index.match(replica, keys)


def jain(values) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2); 1 when all equal, 1/n when one takes all."""
    xs = [float(v) for v in values]
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if sq else 1.0


def max_over_mean(values) -> float:
    xs = [float(v) for v in values]
    mean = sum(xs) / len(xs) if xs else 0.0
    return max(xs) / mean if mean else 1.0
