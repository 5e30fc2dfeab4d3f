"""What kvbench knows about a serving engine it replays against (``kvbench replay --endpoint``): its
Prometheus metrics, read into kvbench's names, and their timeline over a run (metrics.parquet, and
the steps.parquet rows a live run has); its settings, read from a running server or from a recorded
vLLM start-up log, so that a simulated run can be made with the same pool and limits
(``ServerSettings.replay_fields``).

Engines and their metric names (``ENGINE_METRICS``):
- vLLM v1 (vllm/v1/metrics/loggers.py): prefix-cache queries and hits are counters in tokens; the pool
  is ``vllm:cache_config_info``'s labels; ``kv_cache_usage_perc`` is the share of the pool's blocks
  that requests hold (cached blocks no request holds count as free).
- SGLang (python/sglang/srt/metrics/collector.py, SchedulerMetricsCollector and
  TokenizerMetricsCollector): no lookup counter; ``cached_tokens_total`` over ``prompt_tokens_total``
  (both counted when a request finishes) is its prefix hit rate, ``num_retracted_requests_total`` its
  preemptions, ``token_usage`` its pool use; settings from ``GET /get_server_info``.
Where an engine runs several schedulers (data parallel), their series are summed, fractions averaged.
"""
from __future__ import annotations

import ast
import asyncio
import math
import os
import re
from dataclasses import asdict, dataclass, field

from kvbench.engine.records import STEP_SCHEMA
from kvbench.errors import InputError

METRIC_COLUMNS = ("prefix_cache_queries", "prefix_cache_hits", "preemptions", "kv_cache_usage", "running",
                  "waiting", "prompt_tokens", "generation_tokens", "used_tokens", "cache_hit_rate")


@dataclass(frozen=True, slots=True)
class MetricSource:
    """Where one kvbench column comes from: a metric family and how its series combine."""

    column: str  # one of METRIC_COLUMNS
    name: str  # the Prometheus sample name
    combine: str = "sum"  # "sum" (counts, counters) or "mean" (fractions) over the series


ENGINE_METRICS: dict[str, tuple[MetricSource, ...]] = {
    "vllm": (
        MetricSource("prefix_cache_queries", "vllm:prefix_cache_queries_total"),
        MetricSource("prefix_cache_hits", "vllm:prefix_cache_hits_total"),
        MetricSource("preemptions", "vllm:num_preemptions_total"),
        MetricSource("kv_cache_usage", "vllm:kv_cache_usage_perc", "mean"),
        MetricSource("running", "vllm:num_requests_running"),
        MetricSource("waiting", "vllm:num_requests_waiting"),
        MetricSource("prompt_tokens", "vllm:prompt_tokens_total"),
        MetricSource("generation_tokens", "vllm:generation_tokens_total"),
    ),
    "sglang": (
        MetricSource("prefix_cache_queries", "sglang:prompt_tokens_total"),
        MetricSource("prefix_cache_hits", "sglang:cached_tokens_total"),
        MetricSource("preemptions", "sglang:num_retracted_requests_total"),
        MetricSource("kv_cache_usage", "sglang:token_usage", "mean"),
        MetricSource("running", "sglang:num_running_reqs"),
        MetricSource("waiting", "sglang:num_queue_reqs"),
        MetricSource("prompt_tokens", "sglang:prompt_tokens_total"),
        MetricSource("generation_tokens", "sglang:generation_tokens_total"),
        MetricSource("used_tokens", "sglang:num_used_tokens"),
        MetricSource("cache_hit_rate", "sglang:cache_hit_rate", "mean"),
    ),
}

SCRAPE_TIMEOUT_S = 10.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Sample:
    """One line of a Prometheus text exposition."""

    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (comments and malformed lines skipped)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append(Sample(m.group(1), labels, value))
    return out


def engine_kind(samples: list[Sample]) -> str | None:
    """'vllm' or 'sglang' by the namespace of the metrics, or None for neither."""
    for s in samples:
        kind = s.name.split(":", 1)[0]
        if kind in ENGINE_METRICS:
            return kind
    return None


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """One scrape of /metrics in kvbench's columns (None: the engine does not expose it)."""

    kind: str | None
    values: dict[str, float | None]

    def get(self, column: str) -> float | None:
        return self.values.get(column)


def read_metrics(text: str) -> MetricsSnapshot:
    """A /metrics text in kvbench's columns (METRIC_COLUMNS), by the engine's names (ENGINE_METRICS)."""
    samples = parse_prometheus(text)
    kind = engine_kind(samples)
    values: dict[str, float | None] = dict.fromkeys(METRIC_COLUMNS)
    for src in (ENGINE_METRICS.get(kind, ()) if kind is not None else ()):
        found = [s.value for s in samples if s.name == src.name and math.isfinite(s.value)]
        if found:
            values[src.column] = sum(found) / len(found) if src.combine == "mean" else sum(found)
    return MetricsSnapshot(kind, values)


def metric_names(kind: str | None) -> dict[str, str]:
    """column -> the engine's metric name, for config.json."""
    return {src.column: src.name for src in (ENGINE_METRICS.get(kind, ()) if kind is not None else ())}


@dataclass(slots=True)
class ServerSettings:
    """A server's settings as far as they are known (None: not known). ``num_gpu_blocks`` is the
    pool as the engine counts it; ``null_blocks`` of them no request can hold (vLLM's block 0)."""

    kind: str | None = None  # "vllm", "sglang"
    version: str | None = None
    served_model: str | None = None
    model_path: str | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    null_blocks: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    chunked_prefill: bool | None = None
    prefix_caching: bool | None = None
    vocab_size: int | None = None
    sources: list[str] = field(default_factory=list)  # where the figures were read

    @property
    def usable_blocks(self) -> int | None:
        """Blocks requests can hold: kvbench's --num-blocks for the same pool."""
        return None if self.num_gpu_blocks is None else self.num_gpu_blocks - self.null_blocks

    def replay_fields(self) -> dict:
        """ReplayConfig values for a like-for-like simulated run: only the settings known."""
        fields = {"block_size": self.block_size, "num_blocks": self.usable_blocks,
                  "max_num_seqs": self.max_num_seqs, "max_batched_tokens": self.max_num_batched_tokens,
                  "max_model_len": self.max_model_len, "prefix_cache": self.prefix_caching}
        return {k: v for k, v in fields.items() if v is not None}

    def as_dict(self) -> dict:
        return {**asdict(self), "usable_blocks": self.usable_blocks}

    def fill(self, **known) -> None:
        """Take each known value (not None) for a field that is still unknown."""
        for name, value in known.items():
            if value is not None and getattr(self, name) is None:
                setattr(self, name, value)

    def describe(self) -> str:
        """'vllm 0.32.0, /tmp/model, block 32, 255 blocks' with whatever is known."""
        parts = [" ".join(p for p in (self.kind, self.version) if p) or "unknown server"]
        if self.served_model:
            parts.append(self.served_model)
        if self.block_size is not None:
            parts.append(f"block {self.block_size}")
        if self.usable_blocks is not None:
            parts.append(f"{self.usable_blocks:,} blocks")
        return ", ".join(parts)


# -- /metrics over a run ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Scrape:
    t_s: float
    snapshot: MetricsSnapshot


class MetricsTimeline:
    """/metrics scraped before, during and after the measured requests. Gauges are samples (as good
    as the interval); counters are read as differences from the first scrape."""

    def __init__(self) -> None:
        self.rows: list[Scrape] = []
        self.failures = 0

    @property
    def kind(self) -> str | None:
        return next((row.snapshot.kind for row in self.rows if row.snapshot.kind), None)

    async def scrape(self, client, t_s: float) -> None:
        """GET /metrics with ``client`` (an httpx.AsyncClient on the server's root) at ``t_s``."""
        import httpx

        try:
            r = await client.get("/metrics", timeout=SCRAPE_TIMEOUT_S)
        except httpx.HTTPError:
            self.failures += 1
            return
        if r.status_code != 200:
            self.failures += 1
            return
        self.rows.append(Scrape(t_s, read_metrics(r.text)))

    async def every(self, client, interval_s: float, clock) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.scrape(client, clock())

    def _series(self, column: str) -> list[tuple[float, float]]:
        return [(row.t_s, v) for row in self.rows if (v := row.snapshot.get(column)) is not None]

    def delta(self, column: str) -> float | None:
        """last - first reading of a counter (None with fewer than two readings)."""
        s = self._series(column)
        return s[-1][1] - s[0][1] if len(s) >= 2 else None

    def time_mean(self, column: str) -> float | None:
        """A gauge's mean over time, each reading holding until the next."""
        s = self._series(column)
        if len(s) < 2 or s[-1][0] <= s[0][0]:
            return s[0][1] if s else None
        return sum(v * (s[k + 1][0] - t) for k, (t, v) in enumerate(s[:-1])) / (s[-1][0] - s[0][0])

    def peak(self, column: str) -> float | None:
        s = self._series(column)
        return max(v for _, v in s) if s else None

    def write(self, path: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols: dict[str, list[float | None]] = {"t_s": [row.t_s for row in self.rows]}
        for c in METRIC_COLUMNS:
            cols[c] = [row.snapshot.get(c) for row in self.rows]
        schema = pa.schema([(name, pa.float64()) for name in cols])
        pq.write_table(pa.table(cols, schema=schema), path, compression="zstd")

    def step_rows(self, blocks_total: int | None, block_size: int | None):
        """steps.parquet rows (STEP_SCHEMA order), one per scrape, each lasting until the next:
        running, waiting; kv_util the engine's pool use (vLLM: blocks held by requests / usable
        blocks, a block-granular figure), blocks_used and slots_allocated from it (the blocks running
        requests hold, a shared block once); hit_tokens_cum / query_tokens_cum from the prefix
        counters since the first scrape. What a server does not show (tokens per step, live tokens,
        cached blocks) is null."""
        first = {c: next((v for _, v in self._series(c)), None) for c in ("prefix_cache_hits", "prefix_cache_queries")}

        def since_first(snap: MetricsSnapshot, column: str) -> int | None:
            v, v0 = snap.get(column), first[column]
            return None if v is None or v0 is None else int(v - v0)
        for k, row in enumerate(self.rows):
            snap = row.snapshot
            usage = snap.get("kv_cache_usage")
            used = None if usage is None or blocks_total is None else round(usage * blocks_total)
            until = self.rows[k + 1].t_s if k + 1 < len(self.rows) else row.t_s
            step = dict.fromkeys(STEP_SCHEMA.names)
            step.update(step=k, t_s=row.t_s, dur_ms=(until - row.t_s) * 1e3,
                        running=_int(snap.get("running")), waiting=_int(snap.get("waiting")),
                        blocks_total=blocks_total, blocks_used=used,
                        blocks_free=None if used is None or blocks_total is None else blocks_total - used,
                        slots_allocated=None if used is None or block_size is None else used * block_size,
                        kv_util=usage, hit_tokens_cum=since_first(snap, "prefix_cache_hits"),
                        query_tokens_cum=since_first(snap, "prefix_cache_queries"))
            yield tuple(step.values())


# -- a recorded vLLM start-up log --------------------------------------------------------------
_LOG_PATTERNS = {  # field -> regex whose group 1 is the value (vLLM's api_server / engine lines)
    "version": re.compile(r"\bversion (\d+\.\d+\S*)"),
    "engine_version": re.compile(r"Initializing a V1 LLM engine \(v([^)\s]+)\)"),
    "max_model_len": re.compile(r"Using max model len (\d+)"),
    "override": re.compile(r"Overriding num_gpu_blocks=\d+ with num_gpu_blocks_override=(\d+)"),
    "kv_tokens": re.compile(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens"),
    "non_default": re.compile(r"non-default args: (\{.*\})\s*$"),
}
_ENGINE_CONFIG = {  # field of the 'Initializing a V1 LLM engine ... with config:' line
    "max_seq_len": re.compile(r"\bmax_seq_len=(\d+)"),
    "enable_prefix_caching": re.compile(r"\benable_prefix_caching=(True|False)"),
    "enable_chunked_prefill": re.compile(r"\benable_chunked_prefill=(True|False)"),
    "served_model_name": re.compile(r"\bserved_model_name=([^,]+)"),
    "model": re.compile(r"\bmodel='([^']*)'"),
}


def server_settings_from_log(path: str) -> ServerSettings:
    """The settings a vLLM server started with, from its start-up log: the 'non-default args: {...}'
    line (a Python dict repr), 'Using max model len', the num_gpu_blocks override or the KV cache
    size, the engine's config line. A setting left at vLLM's default that the log does not state
    stays None (vLLM's defaults depend on the hardware and version)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        raise InputError(f"cannot read the server log ({e.strerror or e})", file=path) from None
    found: dict[str, str] = {}
    args: dict = {}
    engine: dict[str, str] = {}
    for line in lines:
        for name, pat in _LOG_PATTERNS.items():
            m = pat.search(line)
            if m and name not in found:
                found[name] = m.group(1)
        if "non-default args:" in line and not args:
            args = _literal_dict(found.get("non_default", ""))
        if "Initializing a V1 LLM engine" in line:
            engine = {k: m.group(1) for k, pat in _ENGINE_CONFIG.items() if (m := pat.search(line))}
    if not (found or engine):
        raise InputError("not a vLLM start-up log: no version, no engine config, no non-default args", file=path)
    s = ServerSettings(kind="vllm", null_blocks=1, sources=[f"log:{os.path.abspath(path)}"])
    s.fill(version=found.get("engine_version") or found.get("version"),
           block_size=args.get("block_size"), max_num_seqs=args.get("max_num_seqs"),
           max_num_batched_tokens=args.get("max_num_batched_tokens"),
           max_model_len=_int(found.get("max_model_len")) or args.get("max_model_len") or _int(engine.get("max_seq_len")),
           num_gpu_blocks=_int(found.get("override")) or args.get("num_gpu_blocks_override"),
           prefix_caching=_bool(engine.get("enable_prefix_caching"), args.get("enable_prefix_caching")),
           chunked_prefill=_bool(engine.get("enable_chunked_prefill"), args.get("enable_chunked_prefill")),
           model_path=engine.get("model") or args.get("model"),
           served_model=_served_name(args.get("served_model_name")) or engine.get("served_model_name"))
    if s.num_gpu_blocks is None and s.block_size and found.get("kv_tokens"):
        s.num_gpu_blocks = int(found["kv_tokens"].replace(",", "")) // s.block_size
    s.fill(served_model=s.model_path)
    s.vocab_size = local_vocab_size(s.model_path)
    return s


def _literal_dict(text: str) -> dict:
    """A dict repr as vLLM logs it; {} when it holds something literal_eval cannot read."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _int(v) -> int | None:
    """An integer from a number or its text ('8,192', '3.0'); None for None or anything else."""
    if v is None:
        return None
    try:
        return int(float(str(v).replace(",", "")))
    except ValueError:
        return None


def _bool(*values) -> bool | None:
    """The first of ``values`` that says True or False (bools or their repr)."""
    for v in values:
        if isinstance(v, bool):
            return v
        if v in ("True", "False", "true", "false"):
            return v.lower() == "true"
    return None


def _served_name(v) -> str | None:
    if isinstance(v, (list, tuple)):
        return str(v[0]) if v else None
    return None if v is None else str(v)


def local_vocab_size(model_path: str | None) -> int | None:
    """The vocabulary of a served model whose folder this machine can read (its config.json), else
    None. Token ids at or above it crash a vLLM CPU worker (an index out of bounds in the embedding)."""
    if not model_path or not os.path.exists(model_path):
        return None
    from kvbench.executors.presets import get_model

    try:
        return get_model(model_path).vocab_size
    except (InputError, KeyError, ValueError, TypeError, OSError):
        return None


# -- a running server ---------------------------------------------------------------------------
def base_url(endpoint: str) -> str:
    """The server's root URL: trailing slashes and a trailing /v1 dropped."""
    url = endpoint.strip().rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def connect_error(url: str, err: Exception) -> InputError:
    """'--endpoint: cannot connect to URL: connection refused' (one line)."""
    reason = str(err).split("] ")[-1].strip() or type(err).__name__
    return InputError(f"cannot connect to {url}: {reason.lower()}", field="--endpoint")


def server_settings_from_server(url: str, headers: dict | None = None, timeout_s: float = 10.0) -> ServerSettings:
    """The settings of a running server: /metrics (vLLM's cache_config_info labels), /v1/models
    (served model, max_model_len), /version, and where the server offers them vLLM's
    /server_info?config_format=json (VLLM_SERVER_DEV_MODE=1) or SGLang's /get_server_info.
    An endpoint that cannot be reached is an InputError naming --endpoint."""
    import httpx

    root = base_url(url)
    s = ServerSettings()
    with httpx.Client(base_url=root, headers=headers or {}, timeout=timeout_s) as client:
        try:
            metrics = client.get("/metrics")
        except httpx.TransportError as e:
            raise connect_error(root, e) from None
        if metrics.status_code == 200:
            samples = parse_prometheus(metrics.text)
            s.kind = engine_kind(samples)
            _from_cache_config(s, samples)
            s.sources.append("/metrics")
        models = _get_json(client, "/v1/models")
        if models and models.get("data"):
            first = models["data"][0]
            s.fill(served_model=first.get("id"), max_model_len=first.get("max_model_len"))
            s.sources.append("/v1/models")
        if s.kind != "vllm":  # SGLang's answer names it (page_size); vLLM's /version alone does not
            _from_sglang(s, client)
        if s.kind != "sglang":
            _from_vllm(s, client)
    s.vocab_size = local_vocab_size(s.model_path or s.served_model)
    return s


def _get_json(client, path: str):
    """GET path as JSON, or None when it fails in any way (the endpoint is optional)."""
    import httpx

    try:
        r = client.get(path)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _from_cache_config(s: ServerSettings, samples: list[Sample]) -> None:
    for smp in samples:
        if smp.name == "vllm:cache_config_info":
            lab = smp.labels
            s.fill(block_size=_int(lab.get("block_size")), num_gpu_blocks=_int(lab.get("num_gpu_blocks")),
                   prefix_caching=_bool(lab.get("enable_prefix_caching")))
            return


def _from_vllm(s: ServerSettings, client) -> None:
    version = _get_json(client, "/version")
    if version and "version" in version:
        s.kind = s.kind or "vllm"
        s.fill(version=str(version["version"]))
    info = _get_json(client, "/server_info?config_format=json")
    cfg = (info or {}).get("vllm_config")
    if isinstance(cfg, dict):
        s.kind = "vllm"
        cache, sched, model = (cfg.get(k) or {} for k in ("cache_config", "scheduler_config", "model_config"))
        s.fill(block_size=cache.get("block_size"), num_gpu_blocks=cache.get("num_gpu_blocks"),
               prefix_caching=cache.get("enable_prefix_caching"), max_num_seqs=sched.get("max_num_seqs"),
               max_num_batched_tokens=sched.get("max_num_batched_tokens"),
               chunked_prefill=sched.get("enable_chunked_prefill"), max_model_len=model.get("max_model_len"),
               model_path=model.get("model"), served_model=_served_name(model.get("served_model_name")))
        s.sources.append("/server_info")
    if s.kind == "vllm":
        s.null_blocks = 1


def _from_sglang(s: ServerSettings, client) -> None:
    """SGLang's /get_server_info: its server args and scheduler info (page_size tokens a page,
    max_total_num_tokens in the pool, max_running_requests, chunked_prefill_size, context_length)."""
    info = _get_json(client, "/get_server_info")
    if not isinstance(info, dict) or "page_size" not in info:
        return
    s.kind = "sglang"
    page = info.get("page_size") or 1
    pool = info.get("max_total_num_tokens")
    chunk = info.get("chunked_prefill_size")
    s.fill(version=info.get("version"), block_size=page,
           num_gpu_blocks=pool // page if isinstance(pool, int) else None,
           max_num_seqs=info.get("max_running_requests"),
           max_num_batched_tokens=chunk if isinstance(chunk, int) and chunk > 0 else info.get("max_prefill_tokens"),
           chunked_prefill=isinstance(chunk, int) and chunk > 0,
           prefix_caching=None if "disable_radix_cache" not in info else not info["disable_radix_cache"],
           max_model_len=info.get("context_length"), model_path=info.get("model_path"),
           served_model=info.get("served_model_name"))
    s.sources.append("/get_server_info")
