"""Layer 1, traces: read/validate (format), token expansion and block keys (tokens), ideal hit rate
(ideal), importers of public formats (importers). Knows nothing of engines."""
from kvbench.trace.format import Request, Segment, iter_trace, load_trace, write_trace
from kvbench.trace.ideal import ideal_hit_rate, ideal_hits
from kvbench.trace.tokens import TokenStreams, block_keys

__all__ = ["Request", "Segment", "iter_trace", "load_trace", "write_trace", "ideal_hit_rate",
           "ideal_hits", "TokenStreams", "block_keys"]
