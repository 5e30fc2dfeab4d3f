"""``kvbench trace whatif``: the curve's properties on the real Mooncake trace and on generated ones
(belady on top, every policy at the ceiling once the budget holds every block, never above it, the
ideal hits at a huge budget), the same hits as a PagedKV replay request by request (the two cannot
drift apart), and the command as a user runs it: table, --json, --out files, bad input."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvbench.memory import PagedKV, SeqKV
from kvbench.memory.policies import CACHE_POLICIES
from kvbench.trace.format import load_trace
from kvbench.trace.ideal import ideal_hits
from kvbench.trace.importers import convert
from kvbench.trace.keys import cached_sequence
from kvbench.trace.tokens import TokenStreams
from kvbench.whatif.blocktrace import prepare
from kvbench.whatif.curve import run_points, simulate
from kvbench.whatif.output import COLUMNS, versus_lru, versus_lru_table

REPO = Path(__file__).resolve().parents[1]
REAL = Path(__file__).resolve().parents[2] / "shared" / "traces" / "real" / "mooncake_conversation.jsonl"
GENERATED = ["chat", "rag", "agent"]


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    """The first 2,000 requests of the real Mooncake conversation trace."""
    if not REAL.exists():
        pytest.skip(f"real trace not found at {REAL}")
    out = tmp_path_factory.mktemp("mooncake") / "mooncake_2000.jsonl"
    convert("mooncake", REAL, out, limit=2000)
    return load_trace(out)


def _traces(mooncake_reqs):
    """(name, requests, block size): the real slice at 64-token blocks keeps the test short."""
    yield "mooncake", mooncake_reqs, 64
    for name in GENERATED:
        yield name, load_trace(REPO / "traces" / f"{name}.jsonl"), 16


FIRST = ("lru", "fifo", "lfu", "belady")  # at every budget of the curve test; the others at two


def _curve(bt, fractions, policies=tuple(CACHE_POLICIES)):
    """Budgets as fractions of the distinct blocks, and each policy's hit tokens at each."""
    budgets = sorted({max(1, int(bt.distinct_blocks * f)) for f in fractions})
    points = run_points(bt, budgets, list(policies))
    return budgets, {(b, p): points[(b, p)].hit_tokens for b in budgets for p in policies}


def test_curve_properties_on_real_and_generated_traces(mooncake):
    for name, reqs, bs in _traces(mooncake):
        bt = prepare(reqs, bs, warmup=0.5)
        budgets, hits = _curve(bt, (0.02, 0.1, 0.3, 1.0), FIRST)
        hits.update(_curve(bt, (0.1, 1.0), [p for p in CACHE_POLICIES if p not in FIRST])[1])
        assert bt.distinct_blocks in budgets
        for (b, p), h in hits.items():
            assert h <= bt.ceiling_hit_tokens, (name, b, p)
            if p in FIRST:
                assert h <= hits[(b, "belady")], (name, b, p, hits)
        for p in CACHE_POLICIES:  # a budget holding every distinct block never evicts
            assert hits[(bt.distinct_blocks, p)] == bt.ceiling_hit_tokens, (name, p)
        small = budgets[0]
        assert hits[(small, "lru")] < bt.ceiling_hit_tokens, name  # the curve is not flat
    # the real trace is where the policy matters: belady strictly ahead somewhere
    bt = prepare(mooncake, 64, warmup=0.5)
    _, hits = _curve(bt, (0.05,))
    assert max(hits.values()) == hits[(max(1, int(bt.distinct_blocks * 0.05)), "belady")]
    assert len(set(hits.values())) > 1


def test_huge_budget_equals_ideal_hits_over_the_window(mooncake):
    for name, reqs, bs in _traces(mooncake):
        warmup = 0.3
        bt = prepare(reqs, bs, warmup=warmup)
        start = int(warmup * len(reqs))
        window: list[int] = []
        ideal_hits(reqs, bs, on_request=lambda r, h: window.append(h) if r.index >= start else None)
        assert bt.window_start == start
        assert bt.ceiling_hit_tokens == sum(window) > 0, name
        huge = 10 * bt.distinct_blocks
        for p in CACHE_POLICIES:
            assert simulate(bt, huge, p).hit_tokens == sum(window), (name, p)


def _pagedkv_hits(reqs, bs, budget_blocks, policy, bt, prefix_mode="hash"):
    """The what-if's model driven through the replay's own PagedKV: lookup, allocate, commit, free
    (radix: node eviction, whole blocks, as SGLang with page size = block size)."""
    streams = TokenStreams()
    kv = PagedKV(budget_blocks, bs, cache_policy=policy, prefix_mode=prefix_mode, radix_partial=False)
    future = bt.future(budget_blocks) if policy == "belady" else None
    out = []
    for i, r in enumerate(reqs):
        s, e = int(bt.starts[i]), int(bt.starts[i + 1])
        tokens = cached_sequence(r, streams.expand(r), streams)
        if prefix_mode == "hash":  # a request too large for the pool runs as its first blocks
            e = min(e, s + budget_blocks)
            tokens = tokens[:budget_blocks * bs]
        elif -(-len(tokens) // bs) > budget_blocks:
            out.append(0)
            continue
        seq = SeqKV(tokens=tokens, next_use=None if future is None else future[s:e])
        hits = kv.lookup(seq, r.prompt_len)
        kv.pool.clock = r.t  # the time simulate tells the policies: the request's arrival
        # whole blocks only (hash: no decode, no partial tail); radix holds the partial one too
        new_tokens = (e - s - len(hits)) * bs if prefix_mode == "hash" else len(tokens) - len(hits) * bs
        assert kv.allocate(seq, new_tokens, hits)
        kv.commit(seq, new_tokens)
        kv.free(seq)
        out.append(len(hits))
    return out


@pytest.mark.parametrize("trace", ["mooncake", "chat"])
def test_same_hits_as_a_pagedkv_replay_request_by_request(trace, mooncake):
    reqs, bs = (mooncake[:400], 64) if trace == "mooncake" else (load_trace(REPO / "traces/chat.jsonl"), 16)
    bt = prepare(reqs, bs)
    for frac in (0.05, 0.2):
        budget = max(int(bt.distinct_blocks * frac), int(np.diff(bt.starts).max()) // 2)
        for p in CACHE_POLICIES:
            seen: list[int] = []
            pt = simulate(bt, budget, p, on_request=lambda i, h: seen.append(h))
            assert pt.evicted_blocks > 0
            assert seen == _pagedkv_hits(reqs, bs, budget, p, bt), (trace, budget, p)


@pytest.mark.parametrize("trace", ["mooncake", "chat", "agent"])
def test_radix_same_hits_as_a_pagedkv_replay_request_by_request(trace, mooncake):
    """Radix mode (SGLang's node eviction): the what-if and PagedKV's radix mode agree request by
    request, at budgets where whole nodes are evicted."""
    reqs, bs = (mooncake[:600], 16) if trace == "mooncake" else (load_trace(REPO / f"traces/{trace}.jsonl"), 16)
    bt = prepare(reqs, bs, future=False)
    for frac in (0.05, 0.2, 0.5):
        budget = max(int(bt.distinct_blocks * frac), int(np.diff(bt.starts).max()))
        seen: list[int] = []
        pt = simulate(bt, budget, "lru", on_request=lambda i, h: seen.append(h), prefix_mode="radix")
        assert pt.evicted_blocks > 0
        assert seen == _pagedkv_hits(reqs, bs, budget, "lru", bt, "radix"), (trace, budget)


def test_processes_give_the_same_points():
    bt = prepare(load_trace(REPO / "traces/rag.jsonl"), 16, warmup=0.5)
    budgets = [bt.distinct_blocks // 20, bt.distinct_blocks // 4]
    one = run_points(bt, budgets, ["lru", "belady"], jobs=1)
    two = run_points(bt, budgets, ["lru", "belady"], jobs=2)
    assert one == two


# ------------------------------------------------------------------------------------- the CLI

def _kvbench(*args):
    return subprocess.run([sys.executable, "-m", "kvbench", "trace", "whatif", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_table_json_and_out_directory(tmp_path):
    trace = str(REPO / "traces/chat.jsonl")
    r = _kvbench(trace, "--budgets", "512MiB,2GiB,64GiB", "--out", str(tmp_path / "w"))
    assert r.returncode == 0, r.stderr
    assert "131,072 bytes of KV per token" in r.stderr  # llama-3.1-8b bf16 = 128 KiB
    for word in ("lru", "fifo", "lfu", "belady", "ceiling", "512MiB", "64GiB"):
        assert word in r.stdout
    df = pd.read_parquet(tmp_path / "w" / "whatif.parquet")
    assert list(df.columns[:5]) == COLUMNS
    assert {"block_size", "model", "kv_bytes_per_token", "warmup", "trace"} <= set(df.columns)
    assert len(df) == 3 * len(CACHE_POLICIES) and set(df.policy) == set(CACHE_POLICIES)
    assert "each policy against lru: hit-rate points (share of the lru -> belady gap closed)" in r.stdout
    assert not re.search(r"-\d+%", r.stdout)  # a loss to lru is never a negative share (fifo loses at 512MiB)
    assert "(below lru)" in r.stdout and re.search(r"\+\d+\.\d\d \(\d+%\)", r.stdout)
    gap = df.set_index(["budget_blocks", "policy"]).gap_closed
    small = df.budget_blocks.min()
    assert gap[(small, "lru")] == 0 and gap[(small, "belady")] == 1
    lru, opt = (df[(df.budget_blocks == small) & (df.policy == p)].hit_tokens.item() for p in ("lru", "belady"))
    arc = df[(df.budget_blocks == small) & (df.policy == "arc")].hit_tokens.item()
    assert gap[(small, "arc")] == pytest.approx((arc - lru) / (opt - lru))
    assert pd.isna(gap[(df.budget_blocks.max(), "arc")])  # every block fits: no gap to close
    from kvbench.report import build_report  # the report shows the same shares

    build_report([str(tmp_path / "w")], str(tmp_path / "report"))
    page = (tmp_path / "report" / "index.html").read_text()
    rate = df.set_index(["budget_blocks", "policy"]).hit_rate
    arc_cell = versus_lru(rate[(small, "arc")], rate[(small, "lru")], rate[(small, "belady")])
    assert f"({gap[(small, 'arc')]:.0%})" in arc_cell or "(below lru)" in arc_cell
    assert "Each policy against lru: hit-rate points" in page and f"<td>{arc_cell}</td>" in page
    assert (df.budget_blocks == df.budget_bytes // (131072 * 16)).all()
    assert (df.hit_rate <= df.ceiling + 1e-12).all()
    assert (tmp_path / "w" / "whatif.png").stat().st_size > 10_000

    r = _kvbench(trace, "--budget-blocks", "100,100000", "--policies", "lru,belady",
                 "--kv-dtype", "fp8", "--warmup", "0", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kv_bytes_per_token"] == 65536 and out["window_requests"] == out["requests"] == 250
    rows = {(x["budget_blocks"], x["policy"]): x for x in out["rows"]}
    assert rows[(100000, "lru")]["hit_rate"] == rows[(100000, "belady")]["hit_rate"] == out["ceiling"]
    assert rows[(100, "lru")]["budget_bytes"] == 100 * 16 * 65536


def test_a_policy_against_lru_reads_as_points_and_a_share_of_the_gap_only_above_lru():
    """The share of the lru -> belady gap is written only where it means something: a policy below
    lru loses points to lru (never '-494%' of a small gap), and with no gap (belady = lru) there is
    no share at all. Mutation: the share written below lru too -> fails."""
    assert versus_lru(0.20, 0.10, 0.30) == "+10.00 (50%)"
    assert versus_lru(0.10, 0.10, 0.30) == "+0.00 (0%)" and versus_lru(0.30, 0.10, 0.30) == "+20.00 (100%)"
    assert versus_lru(0.0502, 0.1, 0.1101) == "-4.98 (below lru)"  # the share would be -494%
    assert versus_lru(0.2, 0.3, 0.3) == "-10.00 (below lru)"  # below lru, no gap
    assert versus_lru(0.3, 0.3, 0.3) == "+0.00" and versus_lru(0.31, 0.3, 0.3) == "+1.00"  # no gap: no share
    assert versus_lru(0.31, 0.3, None) == "+1.00"  # no belady
    assert versus_lru(0.300001, 0.3, 0.4) == "+<0.01 (0%)" and versus_lru(0.299999, 0.3, 0.4) == "-<0.01 (below lru)"
    rows = [{"budget_bytes": b, "budget": label, "policy": p, "hit_rate": v}
            for b, label, rates in ((1 << 30, "1GiB", {"lru": 0.10, "fifo": 0.05, "arc": 0.12, "belady": 0.11}),
                                     (2 << 30, "2GiB", {"lru": 0.30, "fifo": 0.25, "arc": 0.30, "belady": 0.30}))
            for p, v in rates.items()]
    t = versus_lru_table(rows)
    assert t.columns == ["budget", "gap", "fifo", "arc"]
    assert t.rows == [["1GiB", "1.00", "-5.00 (below lru)", "+2.00 (200%)"],
                      ["2GiB", "none", "-5.00 (below lru)", "+0.00"]]
    assert t.best == {(0, 3), (1, 3)}
    assert versus_lru_table([r for r in rows if r["policy"] != "belady"]) is None


@pytest.mark.parametrize("args, field", [
    (["--policies", "lru,mru"], "--policies"),
    (["--budgets", "8GiB,lots"], "--budgets"),
    (["--block-size", "0"], "--block-size"),
    (["--budget-blocks", "0"], "--budget-blocks"),
])
def test_cli_bad_input_is_one_line_exit_2(args, field):
    r = _kvbench(str(REPO / "traces/chat.jsonl"), *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


# ------------------------------------------------------------------------------ learned policy

def test_learned_policy_uses_nothing_after_now(mooncake):
    """Shuffle the future of a trace (the requests after request k, arrivals kept in order), or
    drop half of it: the learned policy evicts the same blocks, in the same order, up to request k.
    belady, which reads the future, does not: the test can tell."""
    import dataclasses
    import random

    from kvbench.memory.learned import LearnedPolicy
    from kvbench.memory.policies import make_policy
    from kvbench.whatif.fit import fit

    reqs, bs, k = mooncake[:600], 64, 300
    model = fit(reqs, bs, warmup=0.5, samples_per_request=8)
    later = random.Random(3).sample(reqs[k:], len(reqs) - k)
    shuffled = reqs[:k] + [dataclasses.replace(r, t=t) for r, t in zip(later, sorted(r.t for r in later))]

    head = prepare(reqs[:k], bs)
    budget = max(int(head.distinct_blocks * 0.1), int(np.diff(head.starts).max()))

    def victims(requests, name):
        bt = prepare(requests, bs)
        n = max(bt.distinct_blocks, 1)
        pol = LearnedPolicy(n, budget, model) if name == "learned" else make_policy(name, n, budget)
        out, pop = [], pol.pop_many
        pol.pop_many = lambda m: out.append(pop(m)) or out[-1]
        upto = []
        simulate(bt, budget, pol, on_request=lambda i, h: upto.append(sum(map(len, out))) if i == k - 1 else None)
        return [b for vs in out for b in vs][:upto[0]]

    thinned = reqs[:k] + reqs[k::2]  # a future with half the requests: some blocks never come back

    assert len(victims(reqs, "learned")) > 100
    for future in (shuffled, thinned):
        assert victims(reqs, "learned") == victims(future, "learned")
        assert victims(reqs, "belady") != victims(future, "belady")


def _fit_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvbench", "trace", "fit-policy", *args],
                          capture_output=True, text=True, timeout=120)


def test_fit_policy_then_whatif_and_replay_with_it(tmp_path):
    """fit-policy writes a model that whatif (--policies learned:FILE) and the pool
    (--cache-policy learned:FILE) take; a file that is no model is refused in one line."""
    trace = str(REPO / "traces/chat.jsonl")
    out = tmp_path / "chat-policy.json"
    r = _fit_cli(trace, "--warmup", "0.5", "-o", str(out))
    assert r.returncode == 0, r.stderr
    m = json.loads(out.read_text())
    assert m["kind"] == "kvbench-learned-policy" and m["fit"]["train_requests"] == 125
    assert m["window_s"] > 0 and len(m["coef"]) == len(m["features"]) == 7
    r = _kvbench(trace, "--budget-blocks", "300,1000", "--policies", f"lru,learned:{out},belady", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert {x["policy"] for x in rows} == {"lru", f"learned:{out}", "belady"}
    assert all(x["hit_rate"] <= x["ceiling"] for x in rows)
    kv = PagedKV(64, 16, cache_policy=f"learned:{out}")
    assert kv.pool.policy.model.window_s == m["window_s"]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for args in (["--policies", f"lru,learned:{bad}"], ["--policies", "lru:x"]):
        r = _kvbench(trace, *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--policies" in r.stderr, r.stderr


def test_replay_tells_the_learned_policy_engine_time(tmp_path):
    """--cache-policy learned:FILE in a replay: the config reads the file (a bad one is an input
    error), and the pool's policy sees the engine's clock in seconds, not a constant."""
    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.replay import Replay
    from kvbench.errors import InputError
    from kvbench.memory.learned import DEFAULT_MODEL

    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(DEFAULT_MODEL))
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(InputError, match="--cache-policy"):
        ReplayConfig(cache_policy=f"learned:{bad}").validate()
    cfg = ReplayConfig(executor="sim", model="llama-3-8b", max_model_len=8192, kv_mem="512MiB", limit=60,
                       cache_policy=f"learned:{policy}").validate()
    rp = Replay(str(REPO / "traces/chat.jsonl"), cfg, str(tmp_path / "run"))
    summary = rp.run()
    pol = rp.replicas[0].kv.pool.policy
    assert summary["cache_evictions"] > 0
    seen = [pol._insert_s[b] for b in range(pol.num_blocks) if rp.replicas[0].kv.pool.key[b] is not None]
    assert len(set(seen)) > 5 and max(seen) > 1.0  # insert times from the engine clock


@pytest.mark.parametrize("change, words", [
    ({"coef": [1e300] * 7}, "coef and intercept"),
    ({"intercept": -1e9}, "coef and intercept"),
    ({"scale": [1e-300] * 7}, "scales"),
    ({"mean": [1e300] * 7}, "means"),
    ({"window_s": 1e300}, "window_s"),
])
def test_a_learned_policy_whose_logits_could_overflow_is_refused(tmp_path, change, words):
    """Finite but extreme numbers would make inf - inf = NaN priorities in the policy's heap: refused
    in one line when the file is read."""
    from kvbench.engine.config import ReplayConfig
    from kvbench.errors import InputError
    from kvbench.memory.learned import DEFAULT_MODEL, LearnedModel

    LearnedModel.from_dict(DEFAULT_MODEL)
    bad = tmp_path / "extreme.json"
    bad.write_text(json.dumps({**DEFAULT_MODEL, **change}))
    with pytest.raises(InputError, match=words):
        ReplayConfig(cache_policy=f"learned:{bad}").validate()


def test_fit_ignores_the_rounding_noise_of_a_constant_feature():
    """A feature constant in the training rows up to rounding has a scale of ~1e-16: standardising by it
    would blow that feature's values up. It is treated as constant (scale 1); real spread is kept."""
    from kvbench.memory.learned import MIN_SCALE, LearnedModel
    from kvbench.whatif.fit import fit, standardise

    X = np.array([[0.1 + 0.2, 5.0, 1e6], [0.3, 6.0, 1e6 + 1e-9], [0.30000000000000004, 7.0, 1e6]])
    mean, scale = standardise(X)
    assert scale[0] == 1.0 and scale[2] == 1.0 and scale[1] == pytest.approx(np.std([5.0, 6.0, 7.0]))
    reqs = load_trace(str(REPO / "traces/chat.jsonl"), limit=60)
    m = fit(reqs, 16, warmup=0.5, trace="chat")
    assert min(m.scale) >= MIN_SCALE
    LearnedModel.from_dict(m.to_dict())  # what fit writes, the policy reads
