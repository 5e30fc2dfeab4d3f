"""Layer 3, token eviction inside a sequence: the evictor and its policies (evictor), the CPU pool's
bookkeeping (cpu_pool), the model executor's host KV copies (host_kv), the sim's synthetic attention
(synth)."""
