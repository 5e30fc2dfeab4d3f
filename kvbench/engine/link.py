"""The network between prefill and decode instances (``--disagg P:D``): KV transfers that share links.

Every instance has one network interface per GPU; an instance of ``--tp`` GPUs moves its KV over all
of them at once (each tensor-parallel rank sends or reads its own shard; with MLA every rank holds
and moves a whole copy, which the block's bytes already count), so an instance's link rate is the
preset's per-GPU rate times its GPUs. A transfer runs from a prefill instance's interface (sending)
to a decode instance's (receiving); links are full duplex, so sending and receiving are separate
resources. A transfer's bytes start to flow ``latency`` after it is started (the reader's request
reaching the sender: a NIXL read's setup and notification); transfers flowing at once share the links
max-min fairly (progressive filling: the most constrained link splits its rate equally among its
transfers, and the others take what is left), as concurrent RDMA reads or TCP flows settle.

Rates are nominal line rates per direction; a real transfer reaches some share of them (NIXL over
UCX, RDMA reads of many small blocks), which ``--link-gbps`` sets where it is known.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LinkSpec:
    name: str
    gbps: float  # per GPU, per direction, gigabits per second
    latency_s: float  # per transfer: from its last byte leaving to its completion being seen
    what: str

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


# Nominal per-GPU rates: NVLink 4 (H100/H200 SXM: 900 GB/s both directions, 18 links), one InfiniBand
# or RoCE NIC per GPU (ConnectX-7: 400 Gb/s; 200 Gb/s HDR), 100 Gb Ethernet carrying TCP.
LINKS: dict[str, LinkSpec] = {s.name: s for s in (
    LinkSpec("nvlink", 3600.0, 5e-6, "NVLink 4 within a node (450 GB/s per direction per GPU)"),
    LinkSpec("ib-400", 400.0, 10e-6, "InfiniBand NDR / RoCE 400 Gb/s, one NIC per GPU"),
    LinkSpec("ib-200", 200.0, 10e-6, "InfiniBand HDR / RoCE 200 Gb/s, one NIC per GPU"),
    LinkSpec("tcp", 100.0, 100e-6, "100 Gb Ethernet with TCP, one NIC per GPU"),
)}


class Links:
    """Transfers in flight over the instances' links, their rates max-min fair, advanced in time.

    ``start`` a transfer; ``next_end`` says when the next thing happens (a transfer's bytes begin to
    flow, which changes the others' rates, or one completes); ``advance(t)`` moves every transfer to
    ``t`` and returns the ones complete by then. Rates change only when a transfer's bytes begin or
    end, so between those events every transfer moves at a constant rate. O(transfers x links) per
    event."""

    def __init__(self, rate_of: dict[int, float], latency_s: float):
        self.rate_of = rate_of  # link id (an instance's interface) -> bytes per second
        self.latency_s = latency_s
        self.now = 0.0
        # transfer id -> [bytes left, rate, send link, receive link], while its bytes flow
        self.active: dict[int, list] = {}
        self.waiting: list[tuple[float, int, int, int, int]] = []  # (flows from, id, bytes, send, receive)
        self.busy_bytes: dict[int, float] = dict.fromkeys(rate_of, 0.0)  # bytes through each link
        self.busy_s: dict[int, float] = dict.fromkeys(rate_of, 0.0)  # time each link carried a transfer
        self.bytes_total = 0

    def start(self, t: float, tid: int, nbytes: int, send: int, recv: int) -> None:
        """A transfer started at ``t`` (no earlier than the last ``advance``), its bytes flowing from
        ``t + latency``."""
        assert t >= self.now, "a transfer starts no earlier than the links' time"
        self.bytes_total += nbytes
        heapq.heappush(self.waiting, (t + self.latency_s, tid, nbytes, send, recv))

    def next_end(self) -> float | None:
        """When the next transfer's bytes begin to flow or a transfer completes (None: none in flight)."""
        t = self.waiting[0][0] if self.waiting else None
        for left, rate, _, _ in self.active.values():
            end = self.now + left / rate
            if t is None or end < t:
                t = end
        return t

    def advance(self, t: float) -> list[int]:
        """Move to ``t``; -> the transfers complete by then, in the order they completed."""
        done: list[int] = []
        while True:  # a start or an end before t changes the others' rates from then on
            first = None
            for tid, (left, rate, _, _) in self.active.items():
                end = self.now + left / rate
                if end <= t and (first is None or end < first[0]):
                    first = (end, tid)
            waiting = self.waiting
            if waiting and waiting[0][0] <= t and (first is None or waiting[0][0] <= first[0]):
                at, tid, nbytes, send, recv = heapq.heappop(waiting)
                self._move(at)
                if nbytes <= 0:
                    done.append(tid)
                else:
                    self.active[tid] = [float(nbytes), 0.0, send, recv]
                    self._rates()
                continue
            if first is None:
                break
            self._move(first[0])
            self.active[first[1]][0] = 0.0
            for tid in [k for k, v in self.active.items() if v[0] <= v[1] * 1e-12]:  # (every one ending then)
                del self.active[tid]
                done.append(tid)
            self._rates()
        self._move(t)
        return done

    def _move(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            links: set[int] = set()
            for v in self.active.values():
                moved = min(v[0], v[1] * dt)
                v[0] -= moved
                self.busy_bytes[v[2]] += moved
                self.busy_bytes[v[3]] += moved
                links.add(v[2])
                links.add(v[3])
            for k in links:
                self.busy_s[k] += dt
            self.now = t

    def _rates(self) -> None:
        """Max-min fair rates by progressive filling over the links the transfers use."""
        left = {tid: (v[2], v[3]) for tid, v in self.active.items()}
        cap = dict(self.rate_of)
        while left:
            users: dict[int, int] = {}
            for send, recv in left.values():
                users[send] = users.get(send, 0) + 1
                users[recv] = users.get(recv, 0) + 1
            link = min(users, key=lambda k: (cap[k] / users[k], k))
            share = cap[link] / users[link]
            for tid in [t for t, ends in left.items() if link in ends]:
                send, recv = left.pop(tid)
                self.active[tid][1] = share
                cap[send] -= share
                cap[recv] -= share
