"""Results as CSV, for people who open them in a spreadsheet: each parquet table of a run or a sweep
(requests, steps, sweep) beside it as CSV, and summary.json as a one-row summary.csv (scalars only;
a cluster's per-replica list becomes per_replica.csv). The parquet files stay the source of truth.
"""
from __future__ import annotations

import json
import os

from kvbench.errors import InputError

TABLES = ("requests.parquet", "steps.parquet", "transfers.parquet", "sweep.parquet", "metrics.parquet")


def export_csv(path: str, out_dir: str | None = None) -> list[str]:
    """Write CSV copies of the run or sweep directory ``path`` into ``out_dir`` (default: beside the
    parquet files). -> the files written. A directory with no run or sweep in it is an InputError."""
    import pandas as pd

    if not os.path.isdir(path):
        raise InputError("is not a run or sweep directory", file=path)
    dest = out_dir or path
    os.makedirs(dest, exist_ok=True)
    written = []
    for name in TABLES:
        src = os.path.join(path, name)
        if os.path.exists(src):
            try:
                df = pd.read_parquet(src)
            except Exception as e:  # a truncated or foreign file: one line, naming it
                raise InputError(f"cannot read it as parquet ({str(e).splitlines()[0][:120]})", file=src) from None
            target = os.path.join(dest, name.replace(".parquet", ".csv"))
            df.to_csv(target, index=False)
            written.append(target)
    summary_path = os.path.join(path, "summary.json")
    if os.path.exists(summary_path):
        try:
            with open(summary_path, encoding="utf-8") as fh:
                summary = json.load(fh)
        except (OSError, ValueError, RecursionError) as e:
            raise InputError(f"cannot read it as JSON ({e})", file=summary_path) from None
        if not isinstance(summary, dict):
            raise InputError("is not a JSON object", file=summary_path)
        scalars = {k: v for k, v in summary.items() if not isinstance(v, (list, dict))}
        target = os.path.join(dest, "summary.csv")
        pd.DataFrame([scalars]).to_csv(target, index=False)
        written.append(target)
        if isinstance(summary.get("per_replica"), list) and summary["per_replica"]:
            target = os.path.join(dest, "per_replica.csv")
            pd.DataFrame(summary["per_replica"]).to_csv(target, index=False)
            written.append(target)
    if not written:
        raise InputError("holds no run or sweep (no summary.json or parquet table)", file=path)
    return written
