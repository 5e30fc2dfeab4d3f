"""The what-if across replicas (kvbench trace whatif --replicas N --router R): one replica is the plain
what-if; N replicas are N independent what-ifs of the requests each was routed, their hits added (checked
against what-ifs of the split traces run on their own); each router's rule on the trace."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvbench import whatif as wi
from kvbench.trace.format import Request, Segment, load_trace
from kvbench.trace.keys import PrefixKeys, lookup_blocks
from kvbench.whatif import replicas as rep

ROOT = Path(__file__).resolve().parents[1]
CHAT = load_trace(str(ROOT / "traces" / "chat.jsonl"))
POLICIES = ["lru", "fifo", "belady"]


def run(requests, replicas=1, router="round-robin", warmup=0.0, blocks=(64, 256, 1024), **kw):
    budgets = wi.budgets_from_blocks(list(blocks), 1 << 21)
    return wi.whatif(requests, trace="t", model="m", kv_dtype="bf16", kv_bytes_per_token=1 << 17,
                     block_size=16, budgets=budgets, policies=POLICIES, warmup=warmup, replicas=replicas,
                     router=router, **kw)


def hits(w) -> dict:
    return {(r["budget_blocks"], r["policy"]): r["hit_tokens"] for r in w.rows}


def test_one_replica_is_the_plain_whatif():
    """Split into one replica, the trace is itself: same blocks, window, parents and ceiling."""
    bt = wi.prepare(CHAT[:120], 16, 0.5, future=True)
    where = rep.route(bt, 1, "kv-aware")
    assert not where.any()
    (sub,) = rep.split(bt, where, 1, future=True)
    for f in ("ids", "starts", "lookups", "prompt_lens", "parent", "next_use"):
        assert np.array_equal(getattr(sub, f), getattr(bt, f)), f
    assert (sub.window_start, sub.distinct_blocks, sub.ceiling_hit_tokens) == \
        (bt.window_start, bt.distinct_blocks, bt.ceiling_hit_tokens)


@pytest.mark.parametrize("router", ["round-robin", "session", "prefix", "kv-aware"])
def test_replicas_are_independent_whatifs_of_their_requests(router):
    reqs = CHAT[:150]
    w = run(reqs, replicas=3, router=router)
    bt = wi.prepare(reqs, 16)
    where = rep.route(bt, 3, router)
    assert w.replica_requests == np.bincount(where, minlength=3).tolist()
    total = {}
    for r in range(3):
        part = run([q for q, x in zip(reqs, where) if x == r])
        for k, v in hits(part).items():
            total[k] = total.get(k, 0) + v
    assert hits(w) == total
    # the full lru curve is the replicas' summed, and agrees with the table
    curve = dict(zip(w.lru_curve["budget_bytes"], w.lru_curve["hit_rate"]))
    for row in w.rows:
        if row["policy"] == "lru":
            assert curve[row["budget_bytes"]] == pytest.approx(row["hit_rate"])


def _families(n=60, fams=6):
    return [Request(id=f"r{i}", t=float(i), output_len=2, session=f"s{i % 5}",
                    prompt=[Segment("shared", name=f"family/{(i * 7) % fams}", length=128),
                            Segment("unique", length=40)]) for i in range(n)]


def test_router_rules():
    reqs = _families()
    bt = wi.prepare(reqs, 16)
    assert rep.route(bt, 4, "round-robin").tolist() == [i % 4 for i in range(60)]
    # least-loaded with one request at a time: the replica sent the fewest so far
    assert rep.route(bt, 4, "least-loaded").tolist() == [i % 4 for i in range(60)]
    fam = np.array([(i * 7) % 6 for i in range(60)])
    for router in ("prefix", "kv-aware"):  # a family's requests meet on one replica
        where = rep.route(bt, 4, router)
        assert all(len(set(where[fam == f])) == 1 for f in range(6)), router
    where = rep.route(bt, 4, "session")
    sess = np.array([i % 5 for i in range(60)])
    assert all(len(set(where[sess == s])) == 1 for s in range(5))


def test_prefix_aware_routers_beat_round_robin_and_the_routed_ceiling():
    reqs = _families()
    rr, px, kv = (run(reqs, replicas=4, router=r, blocks=(64,)) for r in ("round-robin", "prefix", "kv-aware"))
    assert hits(px)[(64, "lru")] > hits(rr)[(64, "lru")]
    assert hits(kv)[(64, "lru")] > hits(rr)[(64, "lru")]
    # one infinite cache per replica: keeping families together loses nothing, spreading them does
    assert kv.replicas_ceiling == pytest.approx(kv.ceiling) and rr.replicas_ceiling < rr.ceiling


def test_cli_replicas():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvbench", "trace", "whatif", str(ROOT / "traces" / "chat.jsonl"),
                        "--budgets", "1GiB", "--policies", "lru", "--replicas", "2", "--router", "prefix", "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["replicas"] == 2 and d["router"] == "prefix" and sum(d["replica_requests"]) == 250


@pytest.mark.parametrize("router", ["round-robin", "kv-aware"])
def test_the_warmup_window_is_the_whole_traces(router):
    """With a warm-up, what counts is the requests after the whole trace's warm-up, whichever replica
    served them: checked request by request against each replica's own simulation."""
    reqs = CHAT[:160]
    w = run(reqs, replicas=2, router=router, warmup=0.5, blocks=(128,))
    bt = wi.prepare(reqs, 16, 0.5)
    where = rep.route(bt, 2, router)
    want = {p: 0 for p in POLICIES}
    ceiling = 0
    for r in range(2):
        idx = np.flatnonzero(where == r)
        sub = wi.prepare([reqs[i] for i in idx], 16, 0.0, future=True)
        for p in POLICIES:
            got = []
            wi.simulate(sub, 128, p, on_request=lambda i, h, got=got: got.append(h))
            want[p] += sum(h * 16 for i, h in zip(idx, got) if i >= bt.window_start)
        seen = set()
        for i in idx:  # one infinite cache per replica, counted in the window
            k, plen = PrefixKeys(16)(reqs[i])
            look = min(lookup_blocks(plen, 16), len(k))
            h = 0
            while h < look and int(k[h]) in seen:
                h += 1
            ceiling += h * 16 if i >= bt.window_start else 0
            seen.update(int(x) for x in k)
    assert hits(w) == {(128, p): v for p, v in want.items()}
    assert w.replicas_ceiling == pytest.approx(ceiling / bt.window_prompt_tokens)


def test_kv_aware_keeps_the_load_in_balance_when_every_prompt_shares_its_first_block():
    reqs = [Request(id=f"r{i}", t=float(i), output_len=2,
                    prompt=[Segment("shared", name="system", length=64), Segment("unique", length=64)])
            for i in range(400)]
    bt = wi.prepare(reqs, 16)
    sent = np.bincount(rep.route(bt, 4, "kv-aware"), minlength=4)
    # affinity alone would send all 400 to one replica; balance keeps the busiest within the thresholds
    assert sent.min() > 0
    assert sent.max() <= sent.min() + rep.BALANCE_ABS + 1 or sent.max() <= rep.BALANCE_REL * sent.min() + 1


def test_prefix_routing_is_the_engines(tmp_path):
    """The what-if's prefix router sends every request where the engine's does (same ring, same keys)."""
    import pandas as pd

    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.replay import replay

    reqs = CHAT[:120]
    replay(str(ROOT / "traces" / "chat.jsonl"), ReplayConfig(executor="sim", model="llama-3-8b", limit=120,
                                                             replicas=4, router="prefix"), str(tmp_path / "run"))
    engine = pd.read_parquet(tmp_path / "run" / "requests.parquet").set_index("id")["replica"]
    bt = wi.prepare(reqs, 16)
    where = rep.route(bt, 4, "prefix")
    assert [int(engine[r.id]) for r in reqs] == where.tolist()
    assert len(set(where.tolist())) > 1


def test_whatif_json_has_no_nan(tmp_path):
    w = run(CHAT[:30], replicas=2, blocks=(64,))
    w.rows[0]["gap_closed"] = float("nan")  # a figure with no data
    wi.write_outputs(w, str(tmp_path))

    def refuse(name):
        raise AssertionError(f"{name} in whatif.json")
    d = json.loads((tmp_path / "whatif.json").read_text(), parse_constant=refuse)
    assert d["rows"][0]["gap_closed"] is None and d["replicas"] == 2
