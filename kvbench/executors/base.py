"""The executor interface (layer 5): what every executor implements.

The batch it runs and the result it returns are the scheduler's (kvbench.scheduler.batch). Executors
that need token ids and block tables (the model executor) set ``needs_tokens``; the sim executor does
not, and the engine then skips building them.
"""
from __future__ import annotations

from typing import Protocol

from kvbench.scheduler.batch import StepBatch, StepResult


class Executor(Protocol):
    name: str
    needs_tokens: bool

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers (what one pool slot costs)."""

    def bind_pool(self, num_blocks: int, block_size: int) -> None:
        """Allocate (model) or note (sim) a KV pool of ``num_blocks`` blocks of ``block_size`` slots."""

    def execute(self, batch: StepBatch) -> StepResult:
        """Perform the copies, run the step's forward, return its duration (and tokens)."""
