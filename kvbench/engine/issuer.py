"""When each request of a trace is issued: the client's side of a replay, the same for the sim's engine
clock and for a live server's wall clock (kvbench.engine.live).

A request is *ready* at its trace time times the time scale or, with dependent turns, when the answer
it quotes has finished, whichever is later; it is *issued* when it is ready and one of
``max_concurrency`` slots is free (none: no limit), ready requests taking free slots first come first
served -- the semantics of ``vllm bench serve --max-concurrency C``: its requests leave at their
arrival times and wait on a semaphore of C. A trace whose times are all 0 is then a closed loop of C
users. Arrival, queue and TTFT count from the issue time.

Dependent turns: a request whose prompt re-sends a named answer (a ``shared`` segment naming an earlier
request's ``output``) depends on the last earlier request that wrote it, as a chat client sends turn
k+1 only after turn k's answer has arrived. A rejected request finishes when it is issued.

Stages (a profiling load's closed-loop steps, kvbench.engine.profile): the requests in arrival order
split into consecutive stages of (requests, concurrency); a stage's requests go only once every
request of the stage before it has finished, at most its concurrency at once.

Limits (``--max-requests``, ``--max-seconds``, as ``vllm bench serve --num-prompts`` and GuideLLM's
``--max-seconds``): issuing stops after ``max_requests`` requests, or at the first request that would
go more than ``max_seconds`` after the first request's trace time; the requests issued run to the end.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

import numpy as np

from kvbench.trace.format import Request


def answer_dependencies(requests: Sequence[Request]) -> dict[int, int]:
    """position -> position of the request whose answer it re-sends (the last one before it, in trace
    order, whose ``output`` names a stream its prompt quotes). Requests that quote none are absent."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].index)
    return dependencies_in_trace_order((pos, requests[pos]) for pos in order)


def dependencies_in_trace_order(positioned: Iterable[tuple[int, Request]]) -> dict[int, int]:
    """answer_dependencies over (arrival position, request) pairs given in trace order (a trace
    read as a stream: kvbench.trace.stream). Holds the answers' names and the dependencies."""
    writer: dict[str, tuple[int, int]] = {}  # output stream name -> (trace rank, position) of its latest writer
    deps: dict[int, int] = {}
    for rank, (pos, r) in enumerate(positioned):
        quoted = [writer[s.name] for s in r.prompt if s.kind == "shared" and s.name in writer]
        if quoted:
            deps[pos] = max(quoted)[1]
        if r.output is not None:
            writer[r.output] = (rank, pos)
    return deps


class FrontEnd:
    """A server's front end between the client and the engine: each request takes ``request_s`` +
    ``token_s`` x its prompt tokens there, one request at a time in issue order (vLLM's API process
    parses and hands over one request after another), and reaches the scheduler ``latency_s`` after it
    leaves (hops that hold no other request: the process boundary to the engine core, the first token's
    way back); a request too long for the server is refused there, after its turn. TTFT counts from the
    issue. ``servers``: API processes side by side (one per replica), a request taking the first free."""

    def __init__(self, request_s: float = 0.0, token_s: float = 0.0, latency_s: float = 0.0, servers: int = 1):
        self.request_s, self.token_s, self.latency_s = request_s, token_s, latency_s
        self.free = [-math.inf] * servers  # when each server is next free (a heap)

    def __bool__(self) -> bool:
        return self.request_s > 0 or self.token_s > 0 or self.latency_s > 0

    def service_s(self, prompt_len: int) -> float:
        """The front end's own time on a request of ``prompt_len`` tokens (no wait)."""
        return self.request_s + self.token_s * prompt_len

    def admit(self, issue_s: float, prompt_len: int) -> float:
        """When a request issued at ``issue_s`` reaches the engine (or is refused there)."""
        leaves = max(issue_s, self.free[0]) + self.service_s(prompt_len)
        heapq.heapreplace(self.free, leaves)
        return leaves + self.latency_s


class Issuer:
    """Issues ``requests`` (positions 0..n-1, in arrival order) under the rules above. The caller asks
    ``next_time`` when the next request can go, takes it with ``issue``, and reports every finish
    (or rejection) with ``finished``. ``of_times`` issues a trace read as a stream: only the
    arrival times and the dependencies are held."""

    def __init__(self, requests: Sequence[Request], time_scale: float = 1.0,
                 max_concurrency: int | None = None, dependent_turns: bool = False,
                 max_requests: int | None = None, max_seconds: float | None = None,
                 stages: Sequence[tuple[int, int]] | None = None):
        self._init([r.t for r in requests], answer_dependencies(requests) if dependent_turns else {},
                   time_scale, max_concurrency, max_requests, max_seconds, stages)

    @classmethod
    def of_times(cls, times: Sequence[float] | np.ndarray, deps: dict[int, int], time_scale: float = 1.0,
                 max_concurrency: int | None = None, max_requests: int | None = None,
                 max_seconds: float | None = None, stages: Sequence[tuple[int, int]] | None = None) -> Issuer:
        """``times``: trace times in arrival order; ``deps``: dependencies_in_trace_order's."""
        issuer = cls.__new__(cls)
        issuer._init(times, deps, time_scale, max_concurrency, max_requests, max_seconds, stages)
        return issuer

    def _init(self, times: Sequence[float] | np.ndarray, deps: dict[int, int], time_scale: float,
              max_concurrency: int | None, max_requests: int | None, max_seconds: float | None,
              stages: Sequence[tuple[int, int]] | None = None) -> None:
        self.times = times
        self.n = len(times)
        self.time_scale = time_scale
        self.cap = max_concurrency
        self.max_requests = max_requests
        # the last issue time --max-seconds allows (issuer clock); issuing stops for good past it
        self.until_s = self._arrival(0) + max_seconds if max_seconds is not None and self.n else math.inf
        self.stopped = False  # a limit has stopped issuing
        self.deps = deps
        self._dependents: dict[int, list[int]] = {}  # position -> dependents not yet ready
        for pos, dep in self.deps.items():
            self._dependents.setdefault(dep, []).append(pos)
        self.in_flight = 0
        self.issued = 0
        self._next_plain = 0  # the next position in arrival order that is not a dependent
        self._ready: list[tuple[float, int]] = []  # (ready time, position) of dependents now free to go
        # when each free slot became free (a heap; no cap: no slots to wait for)
        self._free: list[float] = [-math.inf] * max_concurrency if max_concurrency else []
        self._last_s = -math.inf  # the line is first come first served: no issue before an earlier one
        self._stages = list(stages or [])  # (requests, concurrency) each, consecutive in arrival order
        if self._stages:
            if sum(n for n, _ in self._stages) != self.n:
                raise ValueError(f"the stages hold {sum(n for n, _ in self._stages)} requests, not {self.n}")
            if any(n < 1 or c < 1 for n, c in self._stages):
                raise ValueError(f"every stage needs a request and a concurrency of at least 1: {self._stages}")
            if deps:  # a stage's line is its own positions; a dependent from the next one would jump it
                raise ValueError("stages and dependent turns do not go together")
            self._stage, self._stage_end = 0, self._stages[0][0]
            self.cap = self._stages[0][1]
            self._free = [-math.inf] * self.cap
        self._last_finish_s = -math.inf

    def done(self) -> bool:
        """No request is left to issue (every one issued, or a limit stopped issuing)."""
        return self.issued == self.n or self.stopped

    def _arrival(self, pos: int) -> float:
        return float(self.times[pos]) * self.time_scale

    def _head(self) -> tuple[float, int] | None:
        """(ready time, position) of the first ready request in line, or None."""
        n = self.n
        while self._next_plain < n and self._next_plain in self.deps:
            self._next_plain += 1  # a dependent joins the line through _ready once its answer is in
        plain = (self._arrival(self._next_plain), self._next_plain) if self._next_plain < n else None
        ready = self._ready[0] if self._ready else None
        if plain is None or (ready is not None and ready < plain):
            return ready
        return plain

    def next_time(self, now: float = -math.inf) -> float | None:
        """When the next request is issued unless something finishes first; None when none can go
        before a finish (every slot busy, or the rest wait on answers), none is left, or a limit stops
        issuing. ``now``: the clock already read (a live run's wall clock, which may be past the
        time a request was due; the time limit holds against the later of the two)."""
        if self.stopped or (self.max_requests is not None and self.issued >= self.max_requests):
            self.stopped = self.issued < self.n
            return None
        if self._stages:
            first = self._head()
            if first is not None and first[1] >= self._stage_end:
                if self.in_flight:  # the stage's last requests are running: the next stage waits for them
                    return None
                self._stage += 1
                n, cap = self._stages[self._stage]
                self._stage_end += n
                self.cap = cap
                self._free = [self._last_finish_s] * cap
        if self.cap is not None and not self._free:
            return None
        head = self._head()
        if head is None:
            return None
        slot = self._free[0] if self.cap is not None else -math.inf
        at = max(head[0], slot, self._last_s)
        if max(at, now) > self.until_s:
            # issue times never go back, so none after this one goes either, unless a request in
            # flight releases a dependent turn due earlier: asked again after the next finish
            self.stopped = self.in_flight == 0 or not self._dependents
            return None
        return at

    def issue(self) -> tuple[int, float]:
        """Take the next request: (its position, its issue time). Only when next_time() is not None."""
        at = self.next_time()
        if at is None:
            raise RuntimeError("no request can be issued now")
        head = self._head()
        assert head is not None  # next_time() was not None
        pos = head[1]
        if self._ready and self._ready[0][1] == pos:
            heapq.heappop(self._ready)
        else:
            self._next_plain += 1
        if self.cap is not None:
            heapq.heappop(self._free)
        self.in_flight += 1
        self.issued += 1
        self._last_s = at
        return pos, at

    def finished(self, pos: int, at: float) -> None:
        """Request ``pos`` finished (or was rejected) at ``at``: its slot frees, its dependents get ready."""
        self.in_flight -= 1
        self._last_finish_s = max(self._last_finish_s, at)
        if self.cap is not None:
            heapq.heappush(self._free, at)
        for dep in self._dependents.pop(pos, ()):
            heapq.heappush(self._ready, (max(self._arrival(dep), at), dep))
