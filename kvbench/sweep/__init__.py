"""Layer 7, sweeps: a grid of replay configurations run into one resumable directory (runner)."""
