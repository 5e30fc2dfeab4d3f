"""Layer 7, the cache what-if: prefix hit rate against KV budget and cache policy from the trace
alone, without the engine: the trace's model (blocktrace), one point and lru's whole curve (curve,
over the compiled cores in compiled), the command's question (query), replicas, tiers and external
stores (replicas, tiers), outputs (output), and the learned policy's fit (fit)."""
from kvbench.whatif.blocktrace import BlockTrace, prepare
from kvbench.whatif.curve import (
           Budget,
           Point,
           budgets_from_blocks,
           budgets_from_bytes,
           run_points,
           simulate,
)
from kvbench.whatif.output import WhatIf, WhatIfHead, format_bytes, gap_table, head, table, write_outputs
from kvbench.whatif.query import whatif

__all__ = ["BlockTrace", "Budget", "Point", "WhatIf", "WhatIfHead", "budgets_from_blocks", "budgets_from_bytes",
           "format_bytes", "gap_table", "head", "prepare", "run_points", "simulate", "table", "whatif",
           "write_outputs"]
