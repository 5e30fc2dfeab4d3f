"""A request's life in the engine (RequestState, one row of requests.parquet) and the sequences that
generate its samples (Sequence: a SeqKV with its scheduling state), as vLLM v1's ``Request``
(vllm/v1/request.py) and nano-vllm's ``Sequence``."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvbench.memory.contracts import SeqKV
from kvbench.trace.format import Request
from kvbench.trace.keys import FlatPieces

NAN = math.nan


@dataclass(slots=True, eq=False)
class RequestState:
    """A request's life in the engine; becomes one row of requests.parquet."""

    req: Request
    arrival_s: float
    prompt: np.ndarray | None  # int32 prompt token ids (None where nothing reads them: the sim without a prefix cache)
    first_sched_s: float = NAN
    first_token_s: float = NAN
    finish_s: float = NAN
    cached_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    evicted_tokens: int = 0
    recalled_tokens: int = 0
    loaded_tokens: int = 0  # of cached_tokens, those loaded from a tier behind the GPU pool
    live_seqs: int = 1
    output_tokens: int = 0
    reject_reason: str | None = None
    samples: list[tuple[int, list[int]]] | None = None  # (seq_id, generated ids) per finished sample
    position: int = -1  # in the replay's arrival order (engine.issuer)
    itl_max_s: float = NAN  # the longest gap between two tokens of one sample
    # a prefill instance's leg of a disaggregated request (engine.disagg): its blocks are held after it
    # finishes, until the decode side has read them (Scheduler.held, release)
    hold: bool = False


@dataclass(slots=True, eq=False)
class Sequence(SeqKV):
    """One sample of a request being generated (``num_tokens``, SeqKV's: prompt + generated tokens).

    ``seats``: the sequences it counts for against ``max_num_seqs``: itself, plus the samples it will
    fork after its first token (n - 1) until it has forked."""

    seq_id: int = 0
    rs: RequestState = field(kw_only=True)  # every sequence serves a request
    sample: int = 0  # which of the request's n samples (kvbench.trace.tokens: its token stream)
    seats: int = 1
    num_out: int = 0
    last_token: int = 0
    last_emit_s: float = NAN  # when it last emitted a token (inter-token latency)
    out_tokens: list[int] | None = None  # generated ids, kept only when the executor needs tokens
    computed_before: int = 0  # KV tokens held before its last preemption (recompute accounting)
    resumed: bool = False
    ev: object = None  # token-eviction state (kvbench.eviction.evictor.SeqState)
    lane: int = -1  # its slot in the scheduler's decode lane while it runs there (kvbench.scheduler.lane)
    # A waiting sequence holds its pieces and block keys, not its tokens: the scheduler builds them
    # when it first considers the sequence for admission (Scheduler._build: trace.keys.sequence_tokens_of)
    pieces: FlatPieces | None = None
    waiting_keys: np.ndarray | None = None
    built: bool = True
    # a decode instance's leg of a disaggregated request (engine.disagg): its prompt's KV is loaded from a
    # prefill instance at its first admission (Scheduler._start_load), then ``loaded`` once it arrived
    remote: bool = False
    loaded: bool = False
