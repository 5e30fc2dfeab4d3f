"""Layer 7, the cache what-if: prefix hit rate against KV budget and cache policy from the trace
alone, without the engine (curve)."""
from kvbench.whatif.curve import WhatIf, prepare, run_points, simulate, whatif

__all__ = ["WhatIf", "prepare", "run_points", "simulate", "whatif"]
