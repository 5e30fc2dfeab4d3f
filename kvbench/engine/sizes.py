"""Sizes the command line reads before any engine exists: the largest block, and KV memory sizes
(``parse_size``). Kept apart from kvbench.engine.config, which imports every registry (memory, eviction,
executors, records), so that a command that only needs a size (``kvbench trace whatif``) does not."""
from __future__ import annotations

import re

from kvbench.errors import InputError

MAX_BLOCK_SIZE = 4096  # tokens per block
MAX_KV_MEM_BYTES = 2**50  # 1 PiB

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str, field: str = "--kv-mem", allow_zero: bool = False) -> int:
    """'80GiB', '16GB', '512MiB', '1e9'-free plain bytes -> bytes. InputError when not a size.
    ``allow_zero``: 0 (in any unit) is a size too."""
    m = _SIZE.match(str(text))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise InputError(f"not a size: {text!r} (e.g. 16GiB, 512MiB, 80GB)", field=field)
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if allow_zero and value == 0:
        return 0
    if not value >= 1:
        raise InputError(f"must be at least one byte, got {text!r}", field=field)
    if value > MAX_KV_MEM_BYTES:
        raise InputError(f"must be at most 1PiB, got {text!r}", field=field)
    return int(value)
