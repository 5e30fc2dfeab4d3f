"""Layer 7, sweeps: the grid of configurations (grid) and the resumable runner, local processes or
Ray (runner)."""
from kvbench.sweep.grid import (
                                NOT_APPLICABLE,
                                Config,
                                add_comparisons,
                                compares,
                                default_sweep_dir,
                                expand,
                                not_applicable,
                                parse_grid,
                                setting_token,
)
from kvbench.sweep.runner import SWEEP_JSON, SWEEP_PARQUET, make_sweep_dir, preflight, run_sweep
from kvbench.sweep.tasks import Event, import_ray

__all__ = ["NOT_APPLICABLE", "Config", "add_comparisons", "compares", "default_sweep_dir", "expand", "not_applicable", "parse_grid",
           "setting_token", "SWEEP_JSON", "SWEEP_PARQUET", "Event", "import_ray", "make_sweep_dir", "preflight", "run_sweep"]
