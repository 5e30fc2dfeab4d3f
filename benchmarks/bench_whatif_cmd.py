"""``kvbench trace whatif`` timed as a command, process start to exit, against kvcache-simulator 0.1.3
(benchmarks/kvcache_simulator/run.py: the peer, its settings matched to kvbench's) on the whole Mooncake
conversation trace: block 512, llama-3.1-8b bf16, 8, 16, 32, 64, 128 and 1024 GiB, lru, fifo and the
offline optimum (kvbench's belady), the last half of the requests counted.

    python benchmarks/bench_whatif_cmd.py [--runs 7] [--trace mooncake_conversation.jsonl]
        [--peer-venv DIR] [--no-first] [--baseline DIR]

Every sample is a process of its own; the modes run in turn, one sample each per round, in an order
that rotates from round to round, so a machine that slows down slows every mode alike. Per mode: wall
time (min, median, max), CPU time (user + system, children included: the peer's C++ process is a
child), and peak RSS (the largest of the process and its children, from wait4).

  peer                    kvcache-simulator, its compiled C++ backend already built (every run after
                          its first): parses the trace and simulates every time
  peer, first run         the same with a fresh $TMPDIR: compiles its C++ backend first (--no-first: skipped)
  kvbench, no cache       KVBENCH_NO_CACHE=1: reads and computes every time (the peer's work)
  kvbench, first run      an empty cache folder: reads, computes, caches the pieces, the trace hashed
                          at the block size, and the answer
  kvbench, pieces cached  the trace's pieces and hashed blocks cached, the answer not (a new question
                          about a trace asked about before)
  kvbench, answer cached  the same question again
  baseline                with --baseline DIR: the kvbench whose sources are in DIR (a checkout of an
                          older commit: ``git worktree add DIR <commit>``), run with PYTHONPATH=DIR

numba's compiled code is cached already in every kvbench mode (compiling it is once per install).
Both tools run with bytecode caches on (PYTHONPYCACHEPREFIX in the scratch folder; one untimed run of
each writes them) whatever PYTHONDONTWRITEBYTECODE says, as an installed tool runs. The trace is
converted to kvbench's format first (not timed) and left alone for RACY s, since a trace younger than
that is not cached (kvbench.trace.cache). Every kvbench mode must print the same table, or the
benchmark stops.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "kvcache_simulator"))
import run as peer  # noqa: E402  (benchmarks/kvcache_simulator/run.py)

import kvbench.jit  # noqa: E402,F401  (sets NUMBA_CACHE_DIR where the install is read-only: children inherit it)
from kvbench.trace.cache import RACY_NS  # noqa: E402

BUDGETS = ",".join(f"{b}GiB" for b in peer.BUDGETS_GIB)


def timed(cmd: list[str], env: dict, out: Path) -> tuple[float, float, float, int]:
    """(wall s, CPU s, peak RSS MB, exit code) of one process, its stdout to ``out``, run in out's folder
    (not the checkout, whose kvbench ``python -m`` would import first whatever PYTHONPATH says)."""
    with open(out, "wb") as fh:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.DEVNULL, env=env, cwd=out.parent)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, p.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="samples per mode")
    ap.add_argument("--trace", type=Path, default=peer.MOONCAKE, help="Mooncake's own JSONL")
    ap.add_argument("--peer-venv", type=Path, default=peer.default_venv())
    ap.add_argument("--no-first", action="store_true", help="skip the peer's first run (a C++ compile each)")
    ap.add_argument("--baseline", type=Path, help="a kvbench source tree to time beside this one")
    a = ap.parse_args()
    exe = peer.ensure_venv(a.peer_venv)
    scratch = Path(tempfile.mkdtemp(prefix="bench-whatif-cmd-"))
    try:
        run(a, exe, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(a, exe: Path, scratch: Path) -> None:
    trace = scratch / "mooncake.jsonl"
    subprocess.run([sys.executable, "-m", "kvbench", "trace", "convert", "--from", "mooncake", str(a.trace),
                    "-o", str(trace)], check=True, stderr=subprocess.DEVNULL)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "KVBENCH_NO_CACHE")}
    base["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    kvbench = [sys.executable, "-m", "kvbench", "trace", "whatif", str(trace), "--block-size", "512",
               "--model", "llama-3.1-8b", "--kv-dtype", "bf16", "--budgets", BUDGETS, "--policies",
               "lru,fifo,belady"]
    warm = scratch / "warm"
    rounds = iter(range(10**9))

    def kv(xdg: Path, **extra) -> dict:
        return {**base, "XDG_CACHE_HOME": str(xdg), **extra}

    def first() -> dict:
        return kv(scratch / f"first-{next(rounds)}")

    def pieces_only() -> dict:
        shutil.rmtree(warm / "kvbench" / "answers", ignore_errors=True)
        return kv(warm)

    def fresh_tmp() -> dict:
        tmp = scratch / f"tmp-{next(rounds)}"
        tmp.mkdir()
        return {**base, "TMPDIR": str(tmp)}

    modes = {  # name -> (command, a function giving the environment of one sample)
        "peer": (peer.command(exe, a.trace), lambda: base),
        **({} if a.no_first else {"peer, first run": (peer.command(exe, a.trace), fresh_tmp)}),
        "kvbench, no cache": (kvbench, lambda: kv(warm, KVBENCH_NO_CACHE="1")),
        "kvbench, first run": (kvbench, first),
        "kvbench, pieces cached": (kvbench, pieces_only),
        "kvbench, answer cached": (kvbench, lambda: kv(warm)),
        **({} if a.baseline is None else {"baseline": (kvbench, lambda: kv(warm, PYTHONPATH=str(a.baseline)))}),
    }
    time.sleep(max(0.0, RACY_NS / 1e9 + 0.1 - (time.time() - trace.stat().st_mtime)))
    for name in ("peer", "kvbench, answer cached", "baseline"):  # untimed: bytecode, the peer's C++, the cache
        if name not in modes:
            continue
        cmd, env = modes[name]
        timed(cmd, env(), scratch / "untimed.txt")
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in modes}
    outputs: dict[str, bytes] = {}
    names = list(modes)
    load0 = os.getloadavg()[0]
    for r in range(a.runs):
        for name in names[r % len(names):] + names[:r % len(names)]:
            cmd, env = modes[name]
            out = scratch / "out.txt"
            wall, cpu, rss, code = timed(cmd, env(), out)
            if code != 0:
                raise SystemExit(f"{name}: exit {code}: {' '.join(cmd)}")
            samples[name].append((wall, cpu, rss))
            if not name.startswith("peer"):
                outputs.setdefault(name, out.read_bytes())
                if out.read_bytes() != outputs[name] or outputs[name] != next(iter(outputs.values())):
                    raise SystemExit(f"{name}: printed another table than the other kvbench modes")
        print(f"round {r + 1}/{a.runs} done", file=sys.stderr)
    print_table(samples, a.runs, load0)


def print_table(samples: dict, runs: int, load0: float) -> None:
    peer_wall = statistics.median(w for w, _, _ in samples["peer"])
    peer_cpu = statistics.median(c for _, c, _ in samples["peer"])
    print(f"kvbench trace whatif vs kvcache-simulator 0.1.3, whole Mooncake trace (block 512, 6 budgets, "
          f"3 policies); {runs} runs per mode, alternated; {os.cpu_count()} CPUs, load average "
          f"{load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<24} {'wall min':>9} {'median':>7} {'max':>6} {'/ peer':>7} {'CPU s':>6} {'/ peer':>7} "
          f"{'RSS MB':>7}")
    for name, rows in samples.items():
        walls = [w for w, _, _ in rows]
        wall, cpu = statistics.median(walls), statistics.median(c for _, c, _ in rows)
        print(f"{name:<24} {min(walls):9.2f} {wall:7.2f} {max(walls):6.2f} {wall / peer_wall:6.2f}x {cpu:6.2f} "
              f"{cpu / peer_cpu:6.2f}x {max(m for _, _, m in rows):7.0f}")
    print("seconds; CPU: median of user + system, children included (steadier than wall on a shared machine); "
          "/ peer: over the peer's median; RSS: the largest peak")


if __name__ == "__main__":
    main()
