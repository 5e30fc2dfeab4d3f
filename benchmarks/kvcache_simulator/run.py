"""kvcache-simulator 0.1.3 (PyPI ``kvcache-simulator``, KVCache.AI's local hit-rate simulator) on the
Mooncake conversation trace with kvbench's what-if settings: the peer benchmarks/bench_whatif_cmd.py
times ``kvbench trace whatif`` against.

    python benchmarks/kvcache_simulator/run.py [--venv DIR] [--trace mooncake_conversation.jsonl]
        [--budgets-gib 8,16,32,64,128,1024] [--policies lru,fifo,optimal]

The peer is installed with pip into a venv of its own (``--venv``, default
$XDG_CACHE_HOME/kvbench-bench/kvcache-simulator-venv) the first time; it has no dependencies. Its CLI
(kvcache_sim/cli.py) reads Mooncake's own JSONL (hash_ids, input_length), not kvbench's format, so it
is given the original trace where kvbench reads the converted one. Settings, matched to kvbench's:

  kvbench trace whatif           kvcache-simulator run
  --block-size 512               --block-size 512 (Mooncake's hash_ids are 512-token blocks)
  --model llama-3.1-8b           --model llama-3.1-8b --kv-precision bf16_fp16 (131,072 B/token both:
  --kv-dtype bf16                  a 512-token block is 64 MiB, so 8 GiB is 128 blocks in both)
  --budgets 8GiB,...,1024GiB     --budgets-gib 8,...,1024
  --policies lru,fifo,belady     --policies lru,fifo,optimal (its offline optimum)
  --warmup 0.5 (default)         last 50% of requests measured (fixed)

Its C++ backend (the default) is compiled by ``c++ -O3`` into $TMPDIR/kvcache-sim-cpp-<digest> on the
first run and reused after: its first run is the one with a fresh $TMPDIR.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MOONCAKE = REPO.parent / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"
BUDGETS_GIB = (8, 16, 32, 64, 128, 1024)
POLICIES = ("lru", "fifo", "optimal")  # kvbench's lru, fifo, belady


def default_venv() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvbench-bench" / "kvcache-simulator-venv"


def ensure_venv(where: Path) -> Path:
    """The peer's executable in venv ``where``, made and installed with pip (requirements.txt) if absent."""
    exe = where / "bin" / "kvcache-simulator"
    if not exe.exists():
        venv.create(where, with_pip=True)
        subprocess.run([str(where / "bin" / "python"), "-m", "pip", "install", "-q", "-r",
                        str(HERE / "requirements.txt")], check=True)
    return exe


def command(exe: Path, trace: Path, budgets_gib=BUDGETS_GIB, policies=POLICIES, block_size: int = 512) -> list[str]:
    """The peer's command line with kvbench's settings (the module's table)."""
    return [str(exe), "run", "--trace", str(trace), "--model", "llama-3.1-8b", "--kv-precision", "bf16_fp16",
            "--block-size", str(block_size), "--budgets-gib", ",".join(str(b) for b in budgets_gib),
            "--policies", ",".join(policies), "--no-progress"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--venv", type=Path, default=default_venv())
    ap.add_argument("--trace", type=Path, default=MOONCAKE, help="Mooncake's own JSONL (not converted)")
    ap.add_argument("--budgets-gib", default=",".join(map(str, BUDGETS_GIB)))
    ap.add_argument("--policies", default=",".join(POLICIES))
    a = ap.parse_args()
    cmd = command(ensure_venv(a.venv), a.trace, a.budgets_gib.split(","), a.policies.split(","))
    print("$", " ".join(cmd), file=sys.stderr)
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
