"""A kvbench CLI worker for the bad-input tests: runs ``kvbench.cli.main`` on each case it reads (one
JSON object per line on stdin: {"argv": [...], "cwd": dir}) and answers one JSON line: the exit code,
stderr, the seconds taken, the process's peak RSS, and the traceback of any exception that escaped.
One process for hundreds of cases: starting Python and importing kvbench per case would take seconds.
A case that runs longer than ``KVBENCH_CASE_TIMEOUT_S`` is stopped and reported as a hang."""
from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import sys
import time
import traceback

LIMIT_S = int(os.environ.get("KVBENCH_CASE_TIMEOUT_S", "30"))


class Hang(Exception):
    pass


def _alarm(_signum, _frame):
    raise Hang()


def main() -> None:
    # a safety net, not the measure: a case that blows memory fails here instead of taking the machine
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    signal.signal(signal.SIGALRM, _alarm)
    from kvbench.cli.main import main as kvbench_main

    for line in sys.stdin:
        case = json.loads(line)
        err, out = io.StringIO(), io.StringIO()
        code, tb = 0, None
        t0 = time.perf_counter()
        signal.alarm(LIMIT_S)
        try:
            os.chdir(case.get("cwd", "."))
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                kvbench_main(case["argv"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Hang:
            code, tb = -1, f"still running after {LIMIT_S} s"
        except BaseException:  # noqa: BLE001 - what the test looks for
            code, tb = 1, traceback.format_exc()
        finally:
            signal.alarm(0)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()[:2000],
                          "seconds": time.perf_counter() - t0, "peak_rss_mb": rss_mb, "traceback": tb}),
              flush=True)


if __name__ == "__main__":
    main()
