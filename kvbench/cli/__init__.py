"""Layer 8, the command line: the click group (main) and one module per command group."""
from kvbench.cli.main import cli, main

__all__ = ["cli", "main"]
