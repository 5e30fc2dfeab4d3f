"""Five sequential requests that show vLLM's prefix-cache eviction order (block 32, 64-block pool).

Start the server with NUM_GPU_BLOCKS=64 MAX_MODEL_LEN=2016 benchmarks/live/serve_vllm_cpu.sh PORT
(2016 = 63 usable blocks x 32: block 0 is vLLM's null block), then

    python benchmarks/live/repro_eviction_order.py --url http://127.0.0.1:PORT [--out result.json]

The issue's block-16 case scaled by 2: E (64 new tokens), A (64 new), B (= A's tokens), C (1884 new),
F (E's 64 tokens + 32 new); 2 output tokens each, one after another. Prints each request's
cached_tokens and the prefix-cache counters after it. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import urllib.request


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))


def counters(url: str) -> dict:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_cached_total"):
        m = re.search(rf"^vllm:{name}\{{[^}}]*\}} (\S+)", text, re.M)
        out[name] = float(m.group(1)) if m else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip-b", action="store_true", help="leave B out (no duplicate of A's second block)")
    a = ap.parse_args()
    model = json.load(urllib.request.urlopen(a.url + "/v1/models"))["data"][0]["id"]
    rng = random.Random(a.seed)
    new = lambda n: [rng.randrange(3, 32000) for _ in range(n)]  # noqa: E731
    E, A, C = new(64), new(64), new(1884)
    F = E + new(32)
    plan = [("E", E), ("A", A), ("B", list(A)), ("C", C), ("F", F)]
    if a.skip_b:
        plan = [p for p in plan if p[0] != "B"]
    rows = [{"step": "start", **counters(a.url)}]
    for name, prompt in plan:
        r = post(a.url, {"model": model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True,
                         "temperature": 0.0})
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        rows.append({"step": name, "prompt_tokens": r["usage"]["prompt_tokens"], "cached_tokens": cached,
                     **counters(a.url)})
        print(json.dumps(rows[-1]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
