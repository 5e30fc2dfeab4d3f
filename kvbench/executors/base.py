"""The executor interface (layer 5): what every executor implements.

The batch it runs and the result it returns are the scheduler's (kvbench.scheduler.batch). Executors
that need token ids and block tables (the model executor) set ``needs_tokens``; the sim executor does
not, and the engine then skips building them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from kvbench.memory.specs import LayerKV
from kvbench.scheduler.batch import StepBatch, StepResult


class Executor(Protocol):
    name: str
    needs_tokens: bool
    device_name: str  # what config.json records: "sim:h200", "NVIDIA H200", "cpu"
    # InfiniGen's look-ahead: scores the pooled tokens against the coming decode's queries (the model
    # executor's); None where there is no model to ask (the sim)
    speculate: Callable[[list[tuple[int, int, int, np.ndarray]]], dict[int, np.ndarray]] | None
    # a server's front end, before the engine sees a request (engine.issuer.FrontEnd): seconds per
    # request and per prompt token; (0, 0) where requests reach the scheduler as they are issued
    front_end: tuple[float, float, float]  # request_s, per prompt token, latency_s (engine.issuer.FrontEnd)

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers (what one pool slot costs)."""

    def kv_layers(self) -> list[LayerKV]:
        """Each layer's KV cache on one device, at the dtype the executor caches in (the memory
        layer groups them: kvbench.memory.groups)."""

    def default_kv_bytes(self) -> int:
        """The pool's bytes when --kv-mem and --num-blocks are not given."""

    def check_kv_bytes(self, nbytes: int) -> None:
        """Refuse (InputError naming --kv-mem) a pool its devices cannot hold."""

    def bind_tiers(self, bandwidth: dict[str, float], slots: dict[str, int]) -> None:
        """The prefix-cache tiers behind the pool: each one's bandwidth (bytes/s) and slots."""

    def recompute_s(self, start: int, n: int, rest: int = 0) -> float:
        """What prefilling ``n`` tokens after ``start`` cached ones adds to prefilling ``rest`` more."""

    def bind_pool(self, num_blocks: int, block_size: int, layer_groups: list[int] | None = None) -> None:
        """Allocate (model) or note (sim) a KV pool of ``num_blocks`` blocks of ``block_size`` slots.
        ``layer_groups``: per layer, the KV cache group whose block table it reads (a batch's
        ``group_tables``); None: one group, ``block_tables``."""

    def execute(self, batch: StepBatch) -> StepResult:
        """Perform the copies, run the step's forward, return its duration (and tokens)."""
