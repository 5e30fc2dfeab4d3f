"""Drive a small live run against an OpenAI-compatible vLLM server and log client-side token times.

    python benchmarks/live/record_run.py --url http://127.0.0.1:8011 --out run.jsonl \
        [--requests 20] [--concurrency 4] [--seed 0] [--cpu 0]

Standard library only. Every request is a streamed /v1/completions call whose prompt is a list of token
ids (the server runs with --skip-tokenizer-init), with ignore_eos + max_tokens fixing the output length,
return_token_ids and stream_options.include_usage. Half the requests share one 64-token prefix (two
32-token blocks). A closed loop: `concurrency` workers each take the next request as soon as their
previous one finished.

Output, one JSON object a line:
  first line  {"kind": "meta", ...}: url, model, settings, the server's /metrics cache_config_info labels,
              t0_wall (time.time() at the run's start); every other time is time.monotonic() - t0.
  then        {"kind": "request", "index", "prompt_token_ids", "shares_prefix", "max_tokens", "worker",
               "issue_t", "status_t" (response headers in), "chunks": [{"t", "token_ids",
               "finish_reason"}], "usage", "done_t" ([DONE] seen), "id"} in issue order.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import threading
import time
import urllib.parse
import urllib.request

PREFIX_LEN = 64
VOCAB = 32000


def make_requests(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(PREFIX_LEN)]
    reqs = []
    for i in range(n):
        shares = i % 2 == 0
        suffix = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 97))]
        prompt = prefix + suffix if shares else [rng.randrange(3, VOCAB) for _ in range(rng.randrange(40, 161))]
        reqs.append({"index": i, "prompt_token_ids": prompt, "shares_prefix": shares,
                     "max_tokens": rng.choice([4, 8, 16, 24, 32])})
    return reqs


def stream_one(host: str, port: int, model: str, req: dict, t0: float) -> dict:
    body = json.dumps({"model": model, "prompt": req["prompt_token_ids"], "max_tokens": req["max_tokens"],
                       "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    rec = dict(req, chunks=[], usage=None, id=None)
    conn = http.client.HTTPConnection(host, port, timeout=300)
    rec["issue_t"] = time.monotonic() - t0
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    rec["status_t"] = time.monotonic() - t0
    if resp.status != 200:
        raise RuntimeError(f"request {req['index']}: HTTP {resp.status}: {resp.read()[:500]!r}")
    while True:
        line = resp.readline()
        if not line:
            break
        now = time.monotonic() - t0
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            rec["done_t"] = now
            break
        obj = json.loads(data)
        rec["id"] = rec["id"] or obj.get("id")
        if obj.get("usage"):
            rec["usage"] = obj["usage"]
        for ch in obj.get("choices", []):
            rec["chunks"].append({"t": now, "token_ids": ch.get("token_ids") or [],
                                  "finish_reason": ch.get("finish_reason")})
    conn.close()
    return rec


def cache_config(url: str) -> dict:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    m = re.search(r"^vllm:cache_config_info\{(.*)\}", text, re.M)
    return dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) if m else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", type=int, default=None, help="pin this client to one CPU (the server on another)")
    a = ap.parse_args()
    if a.cpu is not None:
        os.sched_setaffinity(0, {a.cpu})
    u = urllib.parse.urlparse(a.url)
    models = json.load(urllib.request.urlopen(a.url + "/v1/models", timeout=30))
    model = models["data"][0]["id"]
    reqs = make_requests(a.requests, a.seed)
    meta = {"kind": "meta", "url": a.url, "model": model, "max_model_len": models["data"][0].get("max_model_len"),
            "requests": a.requests, "concurrency": a.concurrency, "seed": a.seed, "prefix_len": PREFIX_LEN,
            "client_cpu": a.cpu, "cache_config_info": cache_config(a.url)}
    results: list[dict | None] = [None] * len(reqs)
    lock = threading.Lock()
    queue = list(reqs)
    t0 = time.monotonic()
    meta["t0_wall"] = time.time()

    def worker(w: int) -> None:
        while True:
            with lock:
                if not queue:
                    return
                req = queue.pop(0)
            rec = stream_one(u.hostname, u.port or 80, model, req, t0)
            rec["worker"] = w
            results[req["index"]] = rec

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    meta["elapsed_s"] = time.monotonic() - t0
    with open(a.out, "w") as f:
        f.write(json.dumps(meta) + "\n")
        for rec in results:
            f.write(json.dumps({"kind": "request", **rec}) + "\n")
    ntok = sum(len(c["token_ids"]) for r in results for c in r["chunks"])
    cached = sum((r["usage"] or {}).get("prompt_tokens_details", {}).get("cached_tokens") or 0 for r in results)
    print(f"{len(results)} requests, {ntok} output tokens in {meta['elapsed_s']:.2f}s; "
          f"cached prompt tokens {cached}; wrote {a.out}")


if __name__ == "__main__":
    main()
