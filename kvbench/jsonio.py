"""JSON that every parser accepts (layer 0, used by every writer of JSON): NaN and infinities, which
JSON does not have, become null (spec §3: figures with no data are null); numpy scalars become
Python numbers."""
from __future__ import annotations

import json
import math

import numpy as np


def json_safe(v):
    """``v`` with every NaN or infinite float as None and numpy scalars as Python ones; anything else
    that is not JSON becomes its str."""
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    if v is None or isinstance(v, str):
        return v
    return str(v)


def dumps(obj, **kw) -> str:
    return json.dumps(json_safe(obj), allow_nan=False, **kw)
