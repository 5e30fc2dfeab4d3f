"""ReplayConfig: every setting of one replay (spec §1 table), validated in one place.

The CLI, the sweep and tests build it; the engine reads it; config.json records it. Choices that
pick an implementation (layout, cache policy, eviction, executor) are registry names.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from kvbench import eviction, executors, memory, scheduler
from kvbench.engine import routing
from kvbench.engine.lengths import OVERLONG, canonical
from kvbench.engine.records import parse_slo
from kvbench.engine.sizes import MAX_BLOCK_SIZE, parse_size
from kvbench.errors import InputError
from kvbench.memory.policies import check_policy, needs_future
from kvbench.memory.tiers import DEFAULT_BW, LOAD_POLICIES, OFFLOADS
from kvbench.trace.format import MAX_REQUEST_TOKENS

# Choices that pick an implementation come from the registries that hold it.
LAYOUTS = tuple(memory.LAYOUTS)
CACHE_POLICIES = tuple(memory.CACHE_POLICIES)
EVICTIONS = ("none", *eviction.EVICTION_POLICIES)
EXECUTORS = tuple(executors.EXECUTORS)
SLAB_RESERVES = ("max", "exact")
PREFIX_MODES = ("hash", "radix")
RADIX_EVICTIONS = memory.RADIX_EVICTIONS
DEVICES = ("auto", "cuda", "cpu")
ADMISSIONS = scheduler.ADMISSIONS
KV_DTYPES = ("auto", "bf16", "fp16", "fp8", "fp32")  # auto: the dtype the model computes in
DTYPES = ("auto", "bf16", "fp8")  # sim: the weights' dtype; auto: bf16, or the dtype a --calibration measured
ROUTERS = routing.ROUTERS
MAX_TIER_BW_GBPS = 1e6  # GB/s
MAX_STORE_DELAY_S = 3600.0

MAX_NUM_BLOCKS = 2**31 - 1  # block ids are int32 in block tables
MAX_NUM_SEQS = 2**20
MAX_CONCURRENCY = 2**20  # requests in flight (--max-concurrency)
MAX_TIME_SCALE = 1e6
MAX_TP = 64  # GPUs in one tensor-parallel group
MAX_REPLICAS = 1024
MAX_ROUTER_WEIGHT = 1e6


def tier_bytes(text, field: str) -> int:
    """A tier size (``--cpu-kv-mem``, ``--disk-kv-mem``) in bytes: None or 0 (any unit) is no tier."""
    return 0 if text is None else parse_size(text, field, allow_zero=True)


def has_tiers(settings: dict, names=("cpu", "disk", "store")) -> bool:
    """Whether a configuration (a ReplayConfig dict) puts a tier of ``names`` behind the GPU pool."""
    return any(tier_bytes(settings.get(f"{name}_kv_mem"), f"--{name}-kv-mem") for name in names)


def default_model(executor: str, device: str) -> str:
    """The model a run gets when none is named (spec §1): Llama-3-8B on the sim's cost model; the
    tiny random model for the model executor on a CPU (a real 8B forward there takes minutes a step),
    Llama-3-8B's shape with random weights for it on a GPU."""
    if executor != "model":
        return "llama-3-8b"
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "tiny" if device == "cpu" else "llama-3-8b"


@dataclass(slots=True)
class ReplayConfig:
    layout: str = "paged"
    block_size: int = 16
    slab_reserve: str = "max"
    prefix_cache: bool = True
    prefix_mode: str = "hash"
    radix_eviction: str = "node"  # radix: whole LRU leaf nodes (SGLang), or leaf blocks by cache_policy
    cache_policy: str = "lru"
    eviction: str = "none"
    kv_budget: float = 0.2  # < 1: share of the sequence; >= 1: tokens
    sink_tokens: int = 4
    executor: str = "sim"
    model: str | None = None  # None: default_model(executor, device)
    device: str = "auto"
    gpu: str = "h200"
    tp: int = 1  # sim: tensor parallelism (GPUs holding a share of the weights and KV heads)
    kv_dtype: str = "auto"
    dtype: str = "auto"  # sim: weights in bf16 or fp8 (fp8 tensor cores where the GPU has them)
    eager: bool = False  # sim: no CUDA graphs (vLLM --enforce-eager): every layer's kernel launches paid
    # sim: requests pass the API server's front end (presets.REQUEST_S, per token; a calibration's) before
    # the engine; False: none, as vLLM's offline LLM class
    front_end: bool = True
    # a model with sliding-window or chunked-local layers allocated as full attention, one KV cache group
    # (vLLM --disable-hybrid-kv-cache-manager); the compute stays windowed. None: vLLM 0.34's default,
    # on for chunked local attention only (engine/setup.py: kv_layout_of)
    disable_hybrid_kv_cache_manager: bool | None = None
    calibration: str | None = None
    kv_mem: str | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    max_model_len: int | None = None
    overlong: str = "vllm"  # a request longer than max_model_len: the engine's rule (engine/lengths.py)
    admission: str = "full-prompt"
    watermark: float = 0.0
    admission_window: int = 0  # cache-aware admission (vLLM 0.34 cache_aware_admission_window): 0 is off
    admission_threshold: float = 0.5  # ... applied once this share of the pool is held
    time_scale: float = 1.0
    max_concurrency: int | None = None  # closed loop: at most this many requests in flight (engine.issuer)
    dependent_turns: bool = False  # a turn that re-sends an answer waits for it (engine.issuer)
    slo: str | None = None  # 'ttft=200,tpot=50' (ms): goodput counts the requests that meet every one
    limit: int | None = None
    max_requests: int | None = None  # stop issuing after this many requests (engine.issuer)
    max_seconds: float | None = None  # stop issuing this many seconds after the first request (engine.issuer)
    seed: int = 0
    attention: str = "auto"  # model executor: triton kernels or torch reference
    replicas: int = 1  # engine instances, each its own pool, scheduler and executor (engine.routing)
    router: str = "round-robin"
    router_prefix_blocks: int = 4  # prefix router: leading blocks hashed
    router_cache_weight: float = 1.0  # kv-aware: weight of the blocks to prefill
    router_load_weight: float = 1.0  # kv-aware: weight of the replica's active blocks
    router_event_delay: float = 0.0  # kv-aware: engine seconds before a KV event reaches the router
    # prefix-cache tiers behind the GPU pool (kvbench.memory.tiers)
    cpu_kv_mem: str | None = None  # host DRAM tier size; None or 0: none
    disk_kv_mem: str | None = None  # local NVMe tier size
    offload: str = "write-through"  # blocks enter a tier when computed, or when evicted from the one above
    load_policy: str = "auto"  # load only when faster than recomputing, or always
    cpu_bw: float = DEFAULT_BW["cpu"] / 1e9  # GB/s per direction, host <-> GPU
    disk_bw: float = DEFAULT_BW["disk"] / 1e9  # GB/s per direction, NVMe
    cpu_cache_policy: str = "lru"
    disk_cache_policy: str = "lru"
    # a KV store shared by every instance (Mooncake Store, LMCache's remote backend): size, each
    # instance's bandwidth to it, GB/s per direction (one 400 Gb/s RDMA NIC: 50; an SSD pool: ~7), its
    # cache policy, and the seconds after a write's step ends before lookups find it (the store's index)
    store_kv_mem: str | None = None
    store_bw: float = 50.0
    store_cache_policy: str = "lru"
    store_delay: float = 0.0
    store_decode: bool = True  # --disagg: decode instances write their blocks (answers) to the store too
    # prefill/decode disaggregation (engine/disagg.py): "P:D", P prefill and D decode instances, the KV
    # crossing a link between them; None: every replica does both phases
    disagg: str | None = None
    link: str = "ib-400"  # engine.link.LINKS
    link_gbps: float | None = None  # per GPU, per direction: the preset's rate when None
    link_latency_us: float | None = None  # per transfer: the preset's when None
    # NVIDIA Dynamo's conditional disaggregation: a request whose prompt, less what the decode instance it
    # reaches already caches, is at most this many tokens is prefilled there, not sent to a prefill
    # instance (Dynamo's max_local_prefill_length); 0: every request is prefilled remotely (vLLM's proxy)
    disagg_local_prefill: int = 0
    # the decode instances' own hardware, pool and limits where they differ from the prefill ones' (the
    # run's settings); None: the same
    decode_gpu: str | None = None
    decode_tp: int | None = None
    decode_kv_mem: str | None = None
    decode_num_blocks: int | None = None
    decode_max_num_seqs: int | None = None
    decode_max_batched_tokens: int | None = None

    def validate(self) -> "ReplayConfig":
        self.overlong = canonical(self.overlong)

        def choice(name, allowed):
            v = getattr(self, name)
            if v not in allowed:
                raise InputError(f"unknown value {v!r} (choose from {', '.join(allowed)})",
                                 field="--" + name.replace("_", "-"))
        for name, allowed in (("layout", LAYOUTS), ("slab_reserve", SLAB_RESERVES),
                              ("prefix_mode", PREFIX_MODES),
                              ("eviction", EVICTIONS), ("executor", EXECUTORS), ("device", DEVICES),
                              ("kv_dtype", KV_DTYPES), ("dtype", DTYPES), ("admission", ADMISSIONS),
                              ("radix_eviction", RADIX_EVICTIONS), ("router", ROUTERS),
                              ("offload", OFFLOADS), ("load_policy", LOAD_POLICIES), ("overlong", OVERLONG)):
            choice(name, allowed)
        if self.model is None:
            self.model = default_model(self.executor, self.device)
        try:  # a registry name, or learned:FILE (its file read now: a bad one fails before the run)
            check_policy(self.cache_policy, load=True)
        except ValueError as e:
            raise InputError(str(e), field="--cache-policy") from None
        if (self.layout == "paged" and self.prefix_cache and self.prefix_mode == "radix"
                and self.radix_eviction == "node" and self.cache_policy != "lru"):
            raise InputError(f"--radix-eviction node evicts whole nodes by recency, as SGLang does; "
                             f"--cache-policy {self.cache_policy} needs --radix-eviction block", field="--cache-policy")

        def positive(name, v, minimum=1, most=MAX_REQUEST_TOKENS):
            if v is None:
                return
            flag = "--" + name.replace("_", "-")
            if isinstance(v, bool) or not isinstance(v, int):
                raise InputError(f"must be an integer, got {v!r}", field=flag)
            if not minimum <= v <= most:
                raise InputError(f"must be in [{minimum}, {most:,}], got {v}", field=flag)
        positive("block_size", self.block_size, most=MAX_BLOCK_SIZE)
        positive("max_num_seqs", self.max_num_seqs, most=MAX_NUM_SEQS)
        positive("max_batched_tokens", self.max_batched_tokens)
        positive("max_model_len", self.max_model_len)
        positive("num_blocks", self.num_blocks, most=MAX_NUM_BLOCKS)
        positive("limit", self.limit, most=2**31 - 1)
        positive("max_requests", self.max_requests, most=2**31 - 1)
        if self.max_seconds is not None and (isinstance(self.max_seconds, bool)
                                             or not isinstance(self.max_seconds, (int, float))
                                             or not 0 < self.max_seconds < math.inf):
            raise InputError(f"must be a number of seconds > 0, got {self.max_seconds!r}", field="--max-seconds")
        positive("max_concurrency", self.max_concurrency, most=MAX_CONCURRENCY)
        try:
            parse_slo(self.slo)
        except ValueError as e:
            raise InputError(str(e), field="--slo") from None
        positive("sink_tokens", self.sink_tokens, 0)
        positive("seed", self.seed, 0, most=2**63 - 1)
        positive("tp", self.tp, most=MAX_TP)
        positive("replicas", self.replicas, most=MAX_REPLICAS)
        positive("router_prefix_blocks", self.router_prefix_blocks)
        for name in ("router_cache_weight", "router_load_weight", "router_event_delay"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_ROUTER_WEIGHT:
                raise InputError(f"must be a number in [0, {MAX_ROUTER_WEIGHT:g}], got {v!r}",
                                 field="--" + name.replace("_", "-"))
        if self.executor != "sim" and (self.dtype == "fp8" or self.eager is not False):
            raise InputError(f"--dtype fp8 and --eager are modelled by --executor sim; the {self.executor} "
                             "executor runs its own forward", field="--dtype" if self.dtype == "fp8" else "--eager")
        if self.tp != 1 and self.executor != "sim":
            raise InputError(f"tensor parallelism is modelled by --executor sim; the {self.executor} executor "
                             "runs on one device", field="--tp")
        if not (isinstance(self.time_scale, (int, float)) and 0 < self.time_scale <= MAX_TIME_SCALE):
            raise InputError(f"must be a number in (0, {MAX_TIME_SCALE:g}], got {self.time_scale}",
                             field="--time-scale")
        if not (isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 1):
            raise InputError(f"must be in [0, 1), got {self.watermark}", field="--watermark")
        if not (isinstance(self.admission_window, int) and self.admission_window >= 0):
            raise InputError(f"must be a whole number >= 0, got {self.admission_window}", field="--admission-window")
        if not (isinstance(self.admission_threshold, (int, float)) and 0 <= self.admission_threshold <= 1):
            raise InputError(f"must be in [0, 1], got {self.admission_threshold}", field="--admission-threshold")
        b = self.kv_budget
        if not (isinstance(b, (int, float)) and 0 < b <= MAX_REQUEST_TOKENS):
            raise InputError(f"must be a fraction in (0, 1) or a token count, got {b}", field="--kv-budget")
        if b >= 1 and b != int(b):
            raise InputError(f"a budget of 1 or more counts tokens: give a whole number, got {b}",
                             field="--kv-budget")
        if self.kv_mem is not None:
            parse_size(self.kv_mem)
        self._validate_tiers()
        self._validate_limits()
        self._validate_disagg()
        if self.eviction != "none" and not memory.LAYOUTS[self.layout].can_compact:
            raise InputError(f"token eviction ({self.eviction}) frees slots by packing a sequence's kept tokens, "
                             f"which the {self.layout} layout cannot do: use --layout paged, or --eviction none",
                             field="--eviction")
        if self.layout == "slab":  # a slab cannot share blocks: it has no prefix cache to turn on
            self.prefix_cache = False
        return self

    def _validate_limits(self) -> None:
        """belady reads the future of the requests a run issues: with --max-requests or --max-seconds
        they are the first ones in arrival order (a bound known before the run) unless dependent turns
        reorder them as the run goes."""
        limit = "--max-seconds" if self.max_seconds is not None else "--max-requests" if self.max_requests else None
        policies = (self.cache_policy, *(getattr(self, f"{t}_cache_policy") for t in self.tier_sizes()))
        if (limit and self.dependent_turns and self.prefix_cache
                and any(needs_future(p) for p in policies)):
            raise InputError("belady reads the future of the requests issued, which --dependent-turns decides "
                             "as the run goes: cut the trace with --limit instead", field=limit)

    @property
    def disaggregated(self) -> bool:
        return self.disagg is not None

    DECODE_SETTINGS = ("gpu", "tp", "kv_mem", "num_blocks", "max_num_seqs", "max_batched_tokens")

    def decode_config(self) -> "ReplayConfig":
        """The decode instances' settings: the run's, with each ``decode_*`` given in place of its own (a
        --decode-kv-mem replaces the run's --num-blocks too), validated."""
        changes: dict = {f"decode_{n}": None for n in self.DECODE_SETTINGS}
        for n in self.DECODE_SETTINGS:
            v = getattr(self, f"decode_{n}")
            if v is not None:
                changes[n] = v
        if self.decode_kv_mem is not None and self.decode_num_blocks is None:
            changes["num_blocks"] = None
        try:
            return replace(self, **changes, disagg=None).validate()
        except InputError as e:
            if e.field in {f"--{n.replace('_', '-')}" for n in self.DECODE_SETTINGS}:
                raise InputError(e.reason, file=e.file, line=e.line, field="--decode-" + e.field[2:]) from None
            raise

    @property
    def prefill_instances(self) -> int:
        return int(self.disagg.split(":")[0]) if self.disagg is not None else 0

    @property
    def decode_instances(self) -> int:
        return int(self.disagg.split(":")[1]) if self.disagg is not None else 0

    def _validate_disagg(self) -> None:
        """--disagg P:D: what kvbench models of vLLM's KV-connector P/D (engine/disagg.py), or a refusal
        naming what it does not."""
        from kvbench.engine.link import LINKS

        if self.link not in LINKS:
            raise InputError(f"unknown value {self.link!r} (choose from {', '.join(LINKS)})", field="--link")
        for name, most in (("link_gbps", 1e5), ("link_latency_us", 1e7)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= most):
                raise InputError(f"must be a number in (0, {most:g}], got {v!r}", field="--" + name.replace("_", "-"))
        if isinstance(self.disagg, str) and self.disagg.strip().lower() in ("", "none", "off", "0:0"):
            self.disagg = None  # (a sweep's "none": mixed replicas)
        v = self.disagg_local_prefill
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_REQUEST_TOKENS:
            raise InputError(f"must be a number of tokens >= 0, got {v!r}", field="--disagg-local-prefill")
        if self.disagg is None:
            return
        parts = self.disagg.split(":") if isinstance(self.disagg, str) else []
        if not (len(parts) == 2 and all(p.strip().isdigit() and 1 <= int(p) <= MAX_REPLICAS for p in parts)):
            raise InputError(f"must be P:D, prefill and decode instances each in [1, {MAX_REPLICAS}] (or none), "
                             f"got {self.disagg!r}", field="--disagg")
        self.disagg = f"{int(parts[0])}:{int(parts[1])}"
        self.decode_config()  # (its values checked as the run's are)
        refuse = None
        if self.replicas != 1:
            refuse = ("--replicas", "--disagg P:D sets the instances (P prefill, D decode): not --replicas")
        elif self.layout != "paged":
            refuse = ("--layout", "a KV connector moves paged blocks: disaggregated serving needs --layout paged")
        elif self.prefix_mode != "hash":
            refuse = ("--prefix-mode", "vLLM's KV connectors run with its block-hash prefix cache: --prefix-mode hash")
        elif self.eviction != "none":
            refuse = ("--eviction", "token eviction is not modelled with disaggregated serving")
        elif tier_bytes(self.cpu_kv_mem, "--cpu-kv-mem"):
            refuse = ("--cpu-kv-mem", "an instance's own tiers are not modelled with disaggregated serving "
                      "(a shared store is: --store-kv-mem)")
        elif tier_bytes(self.disk_kv_mem, "--disk-kv-mem"):
            refuse = ("--disk-kv-mem", "an instance's own tiers are not modelled with disaggregated serving "
                      "(a shared store is: --store-kv-mem)")
        elif self.executor != "sim":
            refuse = ("--executor", "disaggregated serving runs on the sim executor (the model executor is one instance)")
        elif needs_future(self.cache_policy):
            refuse = ("--cache-policy", f"{self.cache_policy} reads one pool's future: not modelled with disaggregated serving")
        if refuse is not None:
            raise InputError(refuse[1], field=refuse[0])

    def _validate_tiers(self) -> None:
        v = self.store_delay
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_STORE_DELAY_S:
            raise InputError(f"must be seconds in [0, {MAX_STORE_DELAY_S:g}], got {v!r}", field="--store-delay")
        for name in ("cpu_bw", "disk_bw", "store_bw"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_TIER_BW_GBPS:
                raise InputError(f"must be a bandwidth in GB/s in (0, {MAX_TIER_BW_GBPS:g}], got {v!r}",
                                 field="--" + name.replace("_", "-"))
        for name in ("cpu_cache_policy", "disk_cache_policy", "store_cache_policy"):
            try:
                check_policy(getattr(self, name), load=True)
            except ValueError as e:
                raise InputError(str(e), field="--" + name.replace("_", "-")) from None
        sizes = self.tier_sizes()
        if self.router == "conductor" and self.executor != "sim":
            raise InputError("the conductor router times each prefill by the sim's cost model: use --executor sim",
                             field="--router")
        if not sizes:
            return
        flag = f"--{next(iter(sizes))}-kv-mem"
        if "store" in sizes and self.executor != "sim":
            raise InputError("a store every instance shares is modelled by the sim executor (the model executor's "
                             "tiers are its own memory)", field="--store-kv-mem")
        if self.layout != "paged" or not self.prefix_cache:
            raise InputError("prefix-cache tiers hold cached prefix blocks: they need --layout paged with "
                             "--prefix-cache", field=flag)
        if self.prefix_mode != "hash":
            raise InputError("prefix-cache tiers follow the block-hash chain: use --prefix-mode hash", field=flag)

    def tier_sizes(self) -> dict[str, int]:
        """Bytes per tier name, tiers of size 0 left out."""
        sizes = {"cpu": tier_bytes(self.cpu_kv_mem, "--cpu-kv-mem"),
                 "disk": tier_bytes(self.disk_kv_mem, "--disk-kv-mem"),
                 "store": tier_bytes(self.store_kv_mem, "--store-kv-mem")}
        return {k: v for k, v in sizes.items() if v}

    @property
    def kv_mem_bytes(self) -> int | None:
        return None if self.kv_mem is None else parse_size(self.kv_mem)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
