"""What a serving engine does with a request longer than its max model length (``--overlong``): the
rule of the engine replayed, over a trace's lengths as arrays. One place decides it for the sim's
replay, the pre-run checks, ``--like-server`` and a calibration fitted on a live run.

For a limit L, a prompt of P tokens and an output of O:

- ``vllm`` (the default): a prompt of L tokens or more is refused, since the request must leave room
  for at least one generated token; anything shorter runs, its output capped at L - P. vLLM 0.34's
  server refuses a prompt over max_model_len (``TokenizeParams._token_len_check``), caps
  ``max_tokens`` at max_model_len - prompt length (``get_max_tokens``), so a prompt of exactly L asks
  for 0 tokens and is refused (``SamplingParams._verify_args``: max_tokens must be at least 1); the
  engine finishes a request at max_model_len (``check_stop``).
- ``sglang``: SGLang's server without ``--allow-auto-truncate``. The tokenizer manager refuses a
  prompt of L or more and a prompt + output over L (``TokenizerManager._validate_one_request``); the
  scheduler refuses a prompt of ``max_req_input_len`` = L - 6 or more (``validate_input_length``:
  its ``max_req_len`` is L - 1, less 5) and caps the output at ``max_req_len`` - P - 1 = L - P - 2
  (``Scheduler.init_req_max_new_tokens``).
- ``reject``: any request with P + O over L is refused (neither engine's rule: a strict client).

``truncate``, the old name of ``vllm``'s rule, is still read as it.
"""
from __future__ import annotations

import numpy as np

OVERLONG = ("vllm", "sglang", "reject")
ALIASES = {"truncate": "vllm"}
SGLANG_INPUT_MARGIN = 6  # max_req_input_len = (context_len - 1) - 5
SGLANG_OUTPUT_MARGIN = 2  # max_new_tokens <= (context_len - 1) - prompt - 1


def canonical(rule: str) -> str:
    """The rule's name as OVERLONG has it (an old name mapped onto its rule)."""
    return ALIASES.get(rule, rule)


def engine_rule(kind: str | None) -> str:
    """The rule of a server's engine ('vllm', 'sglang'; vLLM's when unknown)."""
    return "sglang" if kind == "sglang" else "vllm"


def shape_lengths(prompt_len: np.ndarray, output_len: np.ndarray, max_len: int,
                  rule: str) -> tuple[np.ndarray, np.ndarray]:
    """(admitted, output_len as run) per request under ``rule`` for limit ``max_len``: a refused
    request keeps its asked output length; an admitted one's prompt + output is at most max_len."""
    plen = np.asarray(prompt_len, dtype=np.int64)
    olen = np.asarray(output_len, dtype=np.int64)
    rule = canonical(rule)
    if rule == "vllm":
        admitted = plen < max_len
        cap = max_len - plen
    elif rule == "sglang":
        admitted = (plen < max_len - SGLANG_INPUT_MARGIN) & (plen + olen <= max_len)
        cap = max_len - SGLANG_OUTPUT_MARGIN - plen
    elif rule == "reject":
        admitted = plen + olen <= max_len
        cap = olen
    else:
        raise ValueError(f"unknown --overlong rule {rule!r} (choose from {', '.join(OVERLONG)})")
    out = np.where(admitted, np.minimum(olen, np.maximum(cap, 1)), olen)
    return admitted, out


def shape_one(prompt_len: int, output_len: int, max_len: int, rule: str) -> tuple[bool, int]:
    """shape_lengths for one request."""
    ok, out = shape_lengths(np.array([prompt_len]), np.array([output_len]), max_len, rule)
    return bool(ok[0]), int(out[0])


__all__ = ["OVERLONG", "canonical", "engine_rule", "shape_lengths", "shape_one"]
