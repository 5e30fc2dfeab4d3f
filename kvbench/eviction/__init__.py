"""Layer 3, token eviction inside a sequence: the evictor and its policies (evictor), the CPU pool's
bookkeeping (cpu_pool), the model executor's host KV copies (host_kv, torch: imported by the model
executor only), the sim's synthetic attention (synth)."""
from kvbench.eviction.evictor import (
    EVICTION_POLICIES,
    Evictor,
    NoEviction,
    make_evictor,
)

__all__ = ["EVICTION_POLICIES", "Evictor", "NoEviction", "make_evictor"]
