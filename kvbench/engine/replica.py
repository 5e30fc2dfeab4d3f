"""One engine instance of a replay (a replica: its pool, scheduler, executor and token evictor, its clock),
and the step figures it adds up as it runs (Totals)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.eviction.evictor import Evictor, NoEviction
from kvbench.executors import Executor
from kvbench.memory.contracts import KVManager
from kvbench.scheduler import Scheduler


@dataclass(slots=True, eq=False)
class Replica:
    """One engine instance: its pool, scheduler, executor and token evictor, its clock and counters."""

    index: int
    kv: KVManager
    executor: Executor
    evictor: Evictor | NoEviction
    sched: Scheduler
    st: Totals
    clock: float = 0.0
    steps: int = 0
    routed: int = 0
    snap: tuple[int, int, int] | None = None  # its load as its current step started (what a router sees then)
    since: list[int] = field(default_factory=lambda: [0, 0])  # [requests, blocks] routed to it since
    stalled: bool = False  # engine.disagg: nothing it can schedule until a transfer or an arrival

    def load(self, bs: int) -> tuple[int, int, int]:
        """What the replica reports to a router: sequences waiting + running, blocks it can hand
        out, blocks active (held by running sequences, plus what the waiting ones need). O(1)."""
        sched = self.sched
        used, cached, free, _, _ = self.kv.stats()
        return (len(sched.waiting) + len(sched.running), free + cached,
                used + -(-sched.waiting_tokens // bs))

    def load_at(self, t_s: float, bs: int) -> tuple[int, int, int]:
        """The load at ``t_s``: during a step (which the loop has already run to its end), the load
        it started with plus what was routed to the replica since; otherwise the current one."""
        if self.snap is not None and self.clock > t_s:
            n, free, active = self.snap
            return n + self.since[0], free, active + self.since[1]
        return self.load(bs)


@dataclass(slots=True)
class Totals:
    peak: int = 0
    peak_slots: int = 0
    peak_live: int = 0
    completed: int = 0
    rejected: int = 0
    output_tokens: int = 0
    busy_s: float = 0.0
    slots_t: float = 0.0
    live_t: float = 0.0
    running_t: float = 0.0
    util_t: float = 0.0
    pcie_s: float = 0.0
    tier_s: float = 0.0  # tier transfers before forwards (loads, write-backs)
    tier_post_s: float = 0.0  # write-through stores
    tier_bytes: dict[str, list[int]] = field(default_factory=dict)  # tier -> [bytes loaded, bytes stored]
