"""The live replay: a trace sent to a running OpenAI-compatible server (vLLM, SGLang, any
``/v1/completions`` that takes token ids), measured from the client, written as a run directory like
a simulated run's. The server schedules; kvbench only issues requests (kvbench.engine.issuer: the
trace's times, ``--max-concurrency`` slots and dependent turns, on the wall clock) and times what
comes back.

What a run holds: requests.parquet (the measured requests; the warm-up ones are left out), summary.json
with the sim's keys (null where a server does not show a figure), metrics.parquet (the /metrics
timeline) and steps.parquet made from it (``MetricsTimeline.step_rows``). Times are on the issuer's
clock: seconds since the phase began plus the trace time of its first request, as the sim's clock
starts at its first arrival. A failed request is a row whose ``rejected`` holds ``error: ...``; the
run goes on, and ends complete with the count in ``errors``. Ctrl-C keeps every finished row and
writes complete=false.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from kvbench.engine.config import ReplayConfig
from kvbench.engine.issuer import Issuer
from kvbench.engine.lengths import engine_rule
from kvbench.engine.prompts import PromptBuilder
from kvbench.engine.records import (
    TOKEN_SCHEMA,
    RunWriter,
    Table,
    claim_run_dir,
    distribution,
    environment,
    goodput,
    holds_run,
    itl_summary,
    parse_slo,
)
from kvbench.engine.server import (
    MetricsTimeline,
    base_url,
    metric_names,
    server_settings_from_server,
)
from kvbench.errors import InputError
from kvbench.provenance import Invocation, file_sha256
from kvbench.trace.format import Request, load_trace
from kvbench.trace.ideal import ideal_hits

CONNECT_TIMEOUT_S = 10.0
RETRY_BACKOFF_S = 0.25  # times the attempt number, before a request is sent again
ERROR_CHARS = 200  # of a server's error message kept in requests.parquet
# summary.json keys of a simulated run that a client cannot see (spec §3): null in a live run
SIM_ONLY_KEYS = ("queue_ms_mean", "queue_ms_p50", "queue_ms_p90", "queue_ms_p99", "resumed_hit_rate",
                 "internal_frag", "busy_s", "recomputed_tokens", "evicted_tokens", "recalled_tokens",
                 "attention_mass_kept", "offloaded_tokens", "pcie_bytes", "pcie_s", "peak_slots_allocated",
                 "peak_tokens_live", "steps", "kv_bytes_per_token", "kv_bytes_per_block", "kv_cache_groups",
                 "cache_evictions", "cow_copies",
                 "slab_reserve_tokens", "partial_hit_tokens", "hit_rate_cpu", "hit_rate_disk", "bytes_loaded",
                 "bytes_stored", "load_s", "store_s", "bytes_loaded_cpu", "bytes_stored_cpu", "cpu_evictions",
                 "bytes_loaded_disk", "bytes_stored_disk", "disk_evictions", "hit_rate_store", "bytes_loaded_store",
                 "bytes_stored_store", "store_evictions", "tier_declined_tokens", "resumed_loaded_tokens")


@dataclass
class LiveOptions:
    """How to reach the server and what to send it (the ReplayConfig holds the workload's settings)."""

    endpoint: str  # base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    api: str = "completions"  # or "chat" (/v1/chat/completions)
    served_model: str | None = None  # the "model" field of each request [default: the server's first]
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    warmup: int = 0  # requests sent first and left out of every statistic
    request_timeout_s: float = 600.0
    retries: int = 2  # a request that fails before its first byte is sent again at most this often
    metrics_interval_s: float = 1.0  # /metrics scraped every so often during the run (0: before and after only)
    remap_vocab: bool = False  # map token ids above the served model's vocabulary onto it, keeping the sharing
    # consecutive stages over the measured requests in arrival order, (requests, concurrency) each: a stage
    # is issued as a closed loop of that many users once the stage before it has finished (a
    # `vllm bench serve --max-concurrency` sweep in one run on one clock; engine.issuer); empty: one
    # stage, the workload's own --max-concurrency
    stages: tuple[tuple[int, int], ...] = ()

    def record(self) -> dict:
        """For config.json: the key and the header values left out (they may be secrets)."""
        d = asdict(self)
        d["api_key"] = None if self.api_key is None else "(given)"
        d["headers"] = sorted(self.headers)
        return d

    def request_headers(self) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**auth, **self.headers}


def request_body(api: str, model: str, prompt: np.ndarray, r: Request, seed: int) -> dict:
    """What is POSTed for one request. Completions: the prompt as token ids. Chat: OpenAI's messages
    take text only, so the ids go as one user message of decimal numbers separated by spaces: the
    server tokenizes that text, so lengths differ from the trace's, but equal id prefixes stay equal
    text prefixes. Greedy unless n > 1 (vLLM refuses n > 1 with greedy sampling: seeded sampling)."""
    body = {"model": model, "max_tokens": r.output_len, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True,
            "temperature": 0.0 if r.n == 1 else 1.0}
    if r.n > 1:
        body.update(n=r.n, seed=seed)
    if api == "chat":
        body["messages"] = [{"role": "user", "content": " ".join(map(str, prompt.tolist()))}]
    else:
        body["prompt"] = prompt.tolist()
    return body


# -- one request's stream ---------------------------------------------------------------------
def sse_data(line: str) -> str | None:
    """The payload of a server-sent event line 'data: ...', or None for any other line."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


@dataclass(slots=True)
class Reply:
    """One request as the client saw it; times on the run clock (seconds). A chunk may carry several
    tokens (the server merges deltas when its API process lags): it is one inter-token gap, as
    vllm bench serve counts them."""

    issue_s: float
    prompt_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float = math.nan
    tokens: dict[int, list[int]] = field(default_factory=dict)  # choice index -> token ids returned
    received: dict[int, int] = field(default_factory=dict)  # choice index -> tokens received
    last_chunk_s: dict[int, float] = field(default_factory=dict)
    gaps: dict[float, int] = field(default_factory=dict)  # gap seconds -> count (records.itl_summary)
    chunks: list[tuple[int, float, int]] = field(default_factory=list)  # (choice, arrival s, tokens) in order
    longest_gap_s: float = 0.0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where reported
    error: str | None = None
    responded: bool = False  # response headers in: a failure from here on is not retried
    status: int | None = None  # the HTTP status
    done: bool = False  # the stream's [DONE] came

    @property
    def output_tokens(self) -> int:
        return sum(self.received.values())

    def take(self, event: dict, t_s: float) -> None:
        """One decoded SSE event that arrived at ``t_s``."""
        if "error" in event:
            self.error = f"error: {one_line_message(event)}"
            return
        details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            self.cached_tokens = int(details["cached_tokens"])
        for ch in event.get("choices") or ():
            ids = ch.get("token_ids")
            n = len(ids) if ids is not None else int(bool(ch.get("text") or (ch.get("delta") or {}).get("content")))
            if not n:
                continue
            i = ch.get("index", 0)
            if ids is not None:
                self.tokens.setdefault(i, []).extend(ids)
            if self.first_token_s is None:
                self.first_token_s = t_s
            last = self.last_chunk_s.get(i)
            if last is not None:
                gap = t_s - last
                self.gaps[gap] = self.gaps.get(gap, 0) + 1
                self.longest_gap_s = max(self.longest_gap_s, gap)
            self.last_chunk_s[i] = t_s
            self.received[i] = self.received.get(i, 0) + n
            self.chunks.append((i, t_s, n))


def one_line_message(obj) -> str:
    """A server's error ({"error": {"message"}}, {"message"}, {"detail"} or text) on one short line."""
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):  # vLLM's 500 has an empty message and a type
        text = str(err.get("message") or err.get("detail") or err.get("type") or json.dumps(err))
    else:
        text = str(err)
    text = " ".join(text.split())
    return text[:ERROR_CHARS] + ("..." if len(text) > ERROR_CHARS else "")


def error_text(raw: bytes) -> str:
    try:
        return one_line_message(json.loads(raw))
    except ValueError:
        return one_line_message(raw.decode("utf-8", "replace"))


async def send_request(client, path: str, body: dict, opts: LiveOptions, clock) -> Reply:
    """POST one streamed request and read it to the end; never raises for the server's failures: an
    HTTP error, a broken stream or a timeout is ``Reply.error``. A failure before the response
    (refused connection, reset) is sent again up to ``opts.retries`` times; the issue time stays."""
    import httpx

    reply = Reply(issue_s=clock())
    for attempt in range(opts.retries + 1):
        try:
            await asyncio.wait_for(_stream(client, path, body, reply, clock), opts.request_timeout_s)
            break
        except asyncio.TimeoutError:
            reply.error = f"error: no answer within {opts.request_timeout_s:g} s (--request-timeout)"
            break
        except httpx.TransportError as e:
            if reply.responded or attempt == opts.retries:
                reply.error = f"error: {type(e).__name__}: {one_line_message(str(e) or 'connection lost')}"
                break
            await asyncio.sleep(RETRY_BACKOFF_S * (attempt + 1))
        except (httpx.HTTPError, ValueError) as e:  # a malformed event or response
            reply.error = f"error: {type(e).__name__}: {one_line_message(str(e))}"
            break
    reply.finish_s = clock()
    return reply


async def _stream(client, path: str, body: dict, reply: Reply, clock) -> None:
    async with client.stream("POST", path, json=body) as resp:
        reply.responded, reply.status = True, resp.status_code
        if resp.status_code != 200:
            reply.error = f"error: HTTP {resp.status_code}: {error_text(await resp.aread())}"
            return
        async for line in resp.aiter_lines():
            data = sse_data(line)
            if data is None:
                continue
            if data == "[DONE]":
                reply.done = True
                return
            reply.take(json.loads(data), clock())
            if reply.error is not None:
                return


# -- the run ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Clock:
    """The issuer's clock: wall seconds since ``t0`` (time.monotonic) plus ``offset``."""

    t0: float
    offset: float

    def __call__(self) -> float:
        return time.monotonic() - self.t0 + self.offset


@dataclass(slots=True)
class _Totals:
    """The measured requests' figures, as they finish."""

    issued: list[Request] = field(default_factory=list)
    served: list[Request] = field(default_factory=list)  # completed
    truncated: int = 0  # completed with fewer tokens than asked (the server's cap)
    errors: int = 0  # failed in any way
    rejected: int = 0  # of those, refused by the server (HTTP 4xx: too long, bad request)
    output_tokens: int = 0
    prompt_tokens: int = 0  # of completed requests
    cached_tokens: int = 0  # of completed requests that report them
    cached_prompt_tokens: int = 0  # the prompt tokens of those
    lat: list[tuple[float, float, float, float]] = field(default_factory=list)  # ttft, tpot, e2e, itl ms
    gaps: list[dict[float, int]] = field(default_factory=list)
    first_issue_s: float = math.inf
    last_finish_s: float = -math.inf


class LiveRun:
    """One live replay of a trace against one server, writing a run directory."""

    def __init__(self, trace_path: str, cfg: ReplayConfig, opts: LiveOptions, out_dir: str, *,
                 force: bool = False, unique: bool = False, invocation: Invocation | None = None):
        self.cfg, self.opts, self.trace_path = cfg.validate(), opts, trace_path
        self.root = base_url(opts.endpoint)
        self.out_dir, self.force, self.unique = out_dir, force, unique
        self.invocation = invocation or Invocation()
        if not unique and not force and os.path.isdir(out_dir) and holds_run(out_dir):
            claim_run_dir(out_dir)  # refuses, naming --out, before the server is asked anything
        reqs = load_trace(trace_path, limit=cfg.limit)
        warm = set(range(min(opts.warmup, len(reqs))))  # the first N in trace order
        self.warm = sorted((r for r in reqs if r.index in warm), key=lambda r: r.t)
        self.measured = sorted((r for r in reqs if r.index not in warm), key=lambda r: r.t)
        if opts.stages:  # refused before the server is asked anything, by the Issuer's own rules
            try:
                Issuer(self.measured, stages=opts.stages, dependent_turns=cfg.dependent_turns)
            except ValueError as e:
                raise InputError(f"{e} (the trace has {len(self.measured)} measured requests)", file=trace_path,
                                 field="stages") from None
        self.server = server_settings_from_server(self.root, opts.request_headers())
        # the server applies its engine's length rule to what it is sent; config.json says which
        self.cfg = replace(self.cfg, overlong=engine_rule(self.server.kind))
        model = opts.served_model or self.server.served_model
        if model is None:
            raise InputError(f"{self.root}/v1/models lists no model: name the one to ask for", field="--served-model")
        self.model = model
        self.vocab_size, self.vocab_source = self._vocab()
        self.prompts = PromptBuilder(reqs, self.vocab_size, opts.remap_vocab, trace_path)
        if opts.api == "completions":
            self.prompts.check_vocab(reqs)
        self.block_size = self.server.block_size or self.cfg.block_size
        self.timeline = MetricsTimeline()
        self.st = _Totals()
        self.writer: RunWriter | None = None
        self.on_progress: Callable[[int, int, int], None] | None = None  # (finished, of, errors)
        self._finished_count = 0

    def describe(self) -> str:
        """One line saying what the run sends where."""
        return f"live: {self.root} ({self.server.describe()}), model {self.model}"

    def _vocab(self) -> tuple[int, str]:
        if self.server.vocab_size is not None:
            return self.server.vocab_size, f"the served model's config.json ({self.server.model_path or self.model})"
        from kvbench.executors.presets import get_model

        assert self.cfg.model is not None  # (validate names one)
        return get_model(self.cfg.model).vocab_size, f"--model {self.cfg.model}"

    def run(self, on_progress: Callable[[int, int, int], None] | None = None) -> dict:
        """Send everything, write the run directory; -> summary.json's contents. ``on_progress(finished,
        of, errors)`` is told as each request finishes."""
        self.on_progress = on_progress
        self.out_dir = claim_run_dir(self.out_dir, force=self.force, unique=self.unique)
        self.writer = RunWriter(self.out_dir, self._config_json())
        self.tokens = Table(os.path.join(self.out_dir, "tokens.parquet"), TOKEN_SCHEMA, 1 << 16)
        complete = False
        wall0 = time.perf_counter()
        try:
            asyncio.run(self._main())
            complete = True
        finally:
            self.tokens.close()
            self.timeline.write(os.path.join(self.out_dir, "metrics.parquet"))
            for row in self.timeline.step_rows(self.server.usable_blocks, self.block_size):
                self.writer.steps.add(row)
            summary = self._summary(complete, time.perf_counter() - wall0)
            self.writer.config.update(self._after_config())
            self.writer.close(summary)
        return summary

    async def _main(self) -> None:
        import httpx

        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=self.root, headers=self.opts.request_headers(), timeout=timeout,
                                     limits=limits) as client:
            if self.warm:
                await self._phase(client, self.warm, self._clock(self.warm), measured=False)
            clock = self._clock(self.measured)
            await self.timeline.scrape(client, clock())
            ticker = None
            if self.opts.metrics_interval_s > 0:
                ticker = asyncio.create_task(self.timeline.every(client, self.opts.metrics_interval_s, clock))
            try:
                await self._phase(client, self.measured, clock, measured=True)
            finally:
                if ticker is not None:
                    ticker.cancel()
            await self.timeline.scrape(client, clock())

    def _clock(self, reqs: list[Request]) -> Clock:
        return Clock(time.monotonic(), reqs[0].t * self.cfg.time_scale if reqs else 0.0)

    async def _phase(self, client, reqs: list[Request], clock: Clock, measured: bool) -> None:
        """Issue ``reqs`` (arrival order) by the Issuer's rules on ``clock`` until none is left or the
        limits stop issuing; return when every request sent has finished."""
        cfg = self.cfg  # --max-requests, --max-seconds and the stages hold in the measured phase only
        issuer = Issuer(reqs, cfg.time_scale, cfg.max_concurrency, cfg.dependent_turns,
                        max_requests=cfg.max_requests if measured else None,
                        max_seconds=cfg.max_seconds if measured else None,
                        stages=self.opts.stages if measured else None)
        pending: dict[asyncio.Task, int] = {}
        while True:
            now = clock()
            nxt = issuer.next_time(now)
            if nxt is not None and nxt <= now:
                pos, _ = issuer.issue()
                pending[asyncio.create_task(self._send(client, reqs[pos], clock))] = pos
                if measured:
                    self.st.issued.append(reqs[pos])
                continue
            if not pending:
                if nxt is None:
                    return
                await asyncio.sleep(nxt - now)
                continue
            done, _ = await asyncio.wait(pending, timeout=None if nxt is None else nxt - now,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                pos = pending.pop(task)
                reply = task.result()
                issuer.finished(pos, reply.finish_s)
                self._finished(reqs[pos], reply, measured)

    async def _send(self, client, r: Request, clock: Clock) -> Reply:
        prompt = self.prompts.build(r)
        body = request_body(self.opts.api, self.model, prompt, r, self.cfg.seed)
        path = "/v1/chat/completions" if self.opts.api == "chat" else "/v1/completions"
        reply = await send_request(client, path, body, self.opts, clock)
        reply.prompt_tokens = len(prompt)
        return reply

    def _finished(self, r: Request, reply: Reply, measured: bool) -> None:
        want = r.output_len * r.n
        cut = reply.error is None and reply.output_tokens < want
        if cut and not reply.done:
            reply.error = f"error: the stream ended after {reply.output_tokens} of {want} tokens"
        elif cut and measured:  # the server capped the output at its max model length (vLLM's get_max_tokens)
            self.st.truncated += 1
        refused = reply.status is not None and 400 <= reply.status < 500
        self.prompts.answer(r, reply.tokens.get(0) if reply.error is None else None, refused)
        if measured:
            self._record(r, reply)
        if self.on_progress is not None:
            self._finished_count += 1
            self.on_progress(self._finished_count, len(self.warm) + len(self.measured), self.st.errors)

    def _record(self, r: Request, reply: Reply) -> None:
        """requests.parquet's row (REQUEST_SCHEMA) and the summary's totals."""
        st, done = self.st, reply.error is None
        st.first_issue_s = min(st.first_issue_s, reply.issue_s)
        st.last_finish_s = max(st.last_finish_s, reply.finish_s)
        nan = math.nan
        per_sample = max(reply.received.values(), default=0)
        first = reply.first_token_s if reply.first_token_s is not None else nan  # (none: a stream with no token)
        ttft = (first - reply.issue_s) * 1e3 if done else nan
        tpot = (reply.finish_s - first) * 1e3 / (per_sample - 1) if done and per_sample > 1 else nan
        e2e = (reply.finish_s - reply.issue_s) * 1e3 if done else nan
        itl_max = reply.longest_gap_s * 1e3 if done else nan
        for choice, t_s, n in reply.chunks:
            self.tokens.add((r.id, choice, t_s, n))
        assert self.writer is not None  # (run opens it before any request)
        self.writer.requests.add((r.id, r.session, None, reply.issue_s, reply.first_token_s, reply.finish_s,
                                  reply.prompt_tokens, reply.cached_tokens, reply.output_tokens, r.n, ttft, tpot,
                                  e2e, None, None, None, None, None, None, reply.error, itl_max))
        if not done:
            st.errors += 1
            st.rejected += reply.status is not None and 400 <= reply.status < 500
            return
        st.served.append(r)
        st.output_tokens += reply.output_tokens
        st.prompt_tokens += reply.prompt_tokens
        if reply.cached_tokens is not None:
            st.cached_tokens += reply.cached_tokens
            st.cached_prompt_tokens += reply.prompt_tokens
        st.lat.append((ttft, tpot, e2e, itl_max))
        st.gaps.append(reply.gaps)

    def _summary(self, complete: bool, wall_s: float) -> dict:
        """summary.json: the sim's keys (SIM_ONLY_KEYS null), figures from the client's timings and the
        server's counters; prefix_hit_rate from the counters over the measured requests,
        client_hit_rate from the cached tokens the server reported per request; errors counts every
        failed request, rejected those the server refused (HTTP 4xx, as the sim's refused requests)."""
        st, tl = self.st, self.timeline
        duration = st.last_finish_s - st.first_issue_s if st.issued else 0.0
        lat = np.array(st.lat, dtype=np.float64).reshape(-1, 4)
        s: dict[str, object]  # summary.json's values
        s = {"complete": complete, "requests": len(st.issued), "completed": len(st.served), "rejected": st.rejected,
             "truncated": st.truncated, "errors": st.errors, "not_issued": len(self.measured) - len(st.issued),
             "warmup_requests": len(self.warm), "duration_s": duration,
             "output_tok_per_s": st.output_tokens / duration if duration > 0 else 0.0,
             "total_tok_per_s": (st.output_tokens + st.prompt_tokens) / duration if duration > 0 else 0.0,
             "req_per_s": len(st.served) / duration if duration > 0 else 0.0}
        for k, name in enumerate(("ttft_ms", "tpot_ms", "e2e_ms")):
            s.update(distribution(name, lat[:, k]))
        s.update(itl_summary(st.gaps))
        s.update(goodput(dict(zip(("ttft", "tpot", "e2e", "itl"), lat.T)), parse_slo(self.cfg.slo), duration))
        hits, queries = tl.delta("prefix_cache_hits"), tl.delta("prefix_cache_queries")
        hit_rate = hits / queries if hits is not None and queries else None
        preempt = tl.delta("preemptions")
        peak = tl.peak("running")
        s.update(dict.fromkeys(SIM_ONLY_KEYS))
        s.update({
            "prefix_hit_rate": hit_rate, "hit_rate_gpu": hit_rate,
            "client_hit_rate": st.cached_tokens / st.cached_prompt_tokens if st.cached_prompt_tokens else None,
            "ideal_hit_rate": self._ideal_hit_rate(), "kv_util": tl.time_mean("kv_cache_usage"),
            "peak_running": None if peak is None else int(peak), "mean_running": tl.time_mean("running"),
            "preemptions": None if preempt is None else int(preempt), "output_tokens": st.output_tokens,
            "num_blocks": self.server.usable_blocks, "block_size": self.block_size,
            "kv_capacity_tokens": None if self.server.usable_blocks is None else self.server.usable_blocks * self.block_size,
            "trace_ideal_hit_rate": self._trace_ideal_hit_rate(),
            "answers_resent": self.prompts.resent, "answers_not_resent": len(self.prompts.fallbacks),
            "metrics_scrapes": len(tl.rows), "metrics_failures": tl.failures, "wall_s": wall_s,
        })
        return s

    def _ideal_hit_rate(self) -> float | None:
        """The ceiling of what was sent: the measured requests the server served, in trace order, at
        its block size, each prompt as sent and each named answer as received (a refused request is
        no lookup, as in the sim)."""
        served = sorted(self.st.served, key=lambda r: r.index)
        return self.prompts.ideal_hits(served, self.block_size).hit_rate if served else None

    def _trace_ideal_hit_rate(self) -> float | None:
        """The same requests' ceiling from the trace's own tokens (what the sim's run reports): equal to
        the ideal of what was sent unless prompts could not continue their answers (fallbacks)."""
        served = sorted(self.st.served, key=lambda r: r.index)
        return ideal_hits(served, self.block_size, self.prompts.streams).hit_rate if served else None

    def _config_json(self) -> dict:
        return {"settings": {**self.cfg.to_dict(), "executor": "live"},
                "trace": {"path": os.path.abspath(self.trace_path), "sha256": file_sha256(self.trace_path),
                          "requests": len(self.warm) + len(self.measured)},
                "endpoint": self.root, "api": self.opts.api, "served_model": self.model,
                "server": self.server.as_dict(), "live": self.opts.record(),
                "prompts": {"vocab_size": self.vocab_size, "vocab_source": self.vocab_source,
                            "remap_vocab": self.opts.remap_vocab},
                "requests_file": "the measured requests only: the warm-up requests are left out",
                "environment": environment(None), **self.invocation.record()}

    def _after_config(self) -> dict:
        kind = self.timeline.kind or self.server.kind
        notes = []
        fallback = self.prompts.fallback_note()
        if fallback is not None:
            notes.append(fallback)
        return {"metrics": {"kind": kind, "names": metric_names(kind), "interval_s": self.opts.metrics_interval_s,
                            "steps_parquet": "one row per /metrics scrape: running, waiting, kv_util (the "
                                             "engine's pool use), prefix counters since the first scrape"},
                "answers": {"resent": self.prompts.resent, "not_resent": len(self.prompts.fallbacks),
                            "not_resent_requests": [[f.request, f.answer_of] for f in self.prompts.fallbacks]},
                "notes": notes}


def replay_live(trace_path: str, cfg: ReplayConfig, opts: LiveOptions, out_dir: str, *, force: bool = False,
                unique: bool = False, invocation: Invocation | None = None) -> tuple[dict, str]:
    """Send the trace to ``opts.endpoint`` and write the run directory; -> (summary, run directory).
    An endpoint that cannot be reached, or a prompt id the served model does not have, is an
    InputError before anything is sent."""
    run = LiveRun(trace_path, cfg, opts, out_dir, force=force, unique=unique, invocation=invocation)
    return run.run(), run.out_dir


__all__ = ["LiveOptions", "LiveRun", "Reply", "replay_live", "request_body", "sse_data"]
