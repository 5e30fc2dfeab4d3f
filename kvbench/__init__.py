"""kvbench: replay LLM request traces through a real paged-KV engine.

Layers (design.md): trace -> memory -> eviction -> scheduler -> executors -> engine -> results/report/cli.
"""

__version__ = "0.1.0"
