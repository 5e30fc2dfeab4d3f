"""Layer 4, the scheduler: continuous batching over a KV manager, one batch per engine step."""
