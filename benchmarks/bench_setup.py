"""A replay's setup (the trace's validating pass and hash, the pool, the checks: ``Replay(...)`` and its
config.json) on a trace never seen, then on the same trace again with its index read back from the
trace cache (kvbench.trace.stream.TraceIndex, kvbench.trace.cache), each in a fresh process with a cache
folder of its own; and the same with the cache off (KVBENCH_NO_CACHE=1).

    python benchmarks/bench_setup.py [TRACE ...] [--rounds 2]

TRACE defaults to the real Mooncake conversation trace, converted first (not timed). A trace younger
than the cache's RACY_NS is not kept, so each trace is copied and the copy aged (its mtime a minute back).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MOONCAKE = HERE.parents[1] / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"

CHILD = r"""
import os, sys, time, tempfile
from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
t1 = time.perf_counter()
rp = Replay(sys.argv[1], ReplayConfig(), os.path.join(tempfile.mkdtemp(), "run"))
sha = rp._config_json()["trace"]["sha256"]
print(len(rp.trace), time.perf_counter() - t1, sha[:12])
"""


def setup_s(trace: str, env: dict) -> tuple[int, float, str]:
    out = subprocess.run([sys.executable, "-c", CHILD, trace], env=env, check=True, capture_output=True,
                         text=True).stdout.split()
    return int(out[0]), float(out[1]), out[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvbench-setup-")
    traces = []
    for t in a.traces:
        traces.append(os.path.join(work, os.path.basename(t)))
        shutil.copyfile(t, traces[-1])
    if not traces:
        from kvbench.trace.importers import convert

        traces = [os.path.join(work, "mooncake.jsonl")]
        convert("mooncake", str(MOONCAKE), traces[0])
    past = time.time_ns() - 60 * 10**9
    for t in traces:
        os.utime(t, ns=(past, past))
    print(f"{'trace':<28} {'requests':>9} {'no cache s':>11} {'first run s':>12} {'read back s':>12}  sha256")
    for t in traces:
        for r in range(a.rounds):
            home = tempfile.mkdtemp(dir=work)
            env = {**os.environ, "XDG_CACHE_HOME": home}
            env.pop("KVBENCH_NO_CACHE", None)
            n, off, sha = setup_s(t, {**env, "KVBENCH_NO_CACHE": "1"})
            _, first, sha1 = setup_s(t, env)
            _, again, sha2 = setup_s(t, env)
            assert sha == sha1 == sha2, (sha, sha1, sha2)
            print(f"{os.path.basename(t)[:28]:<28} {n:>9,} {off:>11.2f} {first:>12.2f} {again:>12.2f}  {sha}", flush=True)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
