"""Prefix-cache tiers behind the GPU pool (kvbench.memory.tiers): lookup along the chain, write-through
and write-back, load-or-recompute, the transfers' cost and order, and real copies in the model executor."""
from __future__ import annotations

import json
import random

import pandas as pd
import pytest

from kvbench.cli.main import main
from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import Replay
from kvbench.executors.presets import get_gpu, get_model
from kvbench.executors.sim import make_sim
from kvbench.memory.policies import CACHE_POLICIES
from kvbench.memory.tiers import Tiers, TierSpec
from kvbench.scheduler.batch import StepBatch
from kvbench.sweep.grid import collapse, not_applicable
from kvbench.trace.format import Request, Segment
from kvbench.trace.tokens import ROOT_KEY

BS = 16
BLOCK_BYTES = get_model("llama-3-8b").kv_bytes_per_token("bf16") * BS  # 2 MiB


def req(i, t, segs, out=2, n=1):
    prompt = tuple(Segment("shared", ln, name=name) if name else Segment("unique", ln) for name, ln in segs)
    return Request(id=f"r{i}", t=t, prompt=prompt, output_len=out, n=n, index=i, line=i + 1,
                   prompt_len=sum(ln for _, ln in segs))


def evict_then_return():
    """A document prompt, three long unique prompts that push it out of a 40-block pool, then the
    document again."""
    return [req(0, 0.0, [("doc", 160)]), req(1, 1.0, [(None, 300)]), req(2, 2.0, [(None, 300)]),
            req(3, 3.0, [(None, 300)]), req(4, 10.0, [("doc", 160)])]


def run(tmp_path, reqs, name="run", num_blocks=40, **kw):
    cfg = ReplayConfig(executor="sim", model="llama-3-8b", block_size=BS, num_blocks=num_blocks, **kw)
    rp = Replay("<test>", cfg, str(tmp_path / name), requests=reqs)
    rp.finished = []
    summary = rp.run()
    rows = pd.read_parquet(tmp_path / name / "requests.parquet").set_index("id")
    steps = pd.read_parquet(tmp_path / name / "steps.parquet")
    return rp, summary, rows, steps


# -- the chain ---------------------------------------------------------------------------------
def chain(n):
    """Keys 1..n chained from the root: (keys, parents)."""
    keys = list(range(1, n + 1))
    return keys, [ROOT_KEY, *keys[:-1]]


def tiers(cpu=8, disk=0, offload="write-through", load="always", cpu_policy="lru"):
    specs = [TierSpec("cpu", cpu, 50e9, cpu_policy), TierSpec("disk", disk, 7e9)]
    return Tiers(specs, offload, load, block_bytes=BLOCK_BYTES)


def test_lookup_continues_block_by_block_through_the_tiers_and_stops_at_the_first_miss():
    t = tiers(cpu=8, disk=8)
    keys, parents = chain(6)
    cpu, disk = t.tiers
    for j in (0, 1, 3):
        cpu.store(keys[j], parents[j])
    for j in (2, 4):
        disk.store(keys[j], parents[j])  # block 5 is nowhere
    m = t.match(keys, 0, 6, ROOT_KEY, BS)
    assert m.tiers == [0, 0, 1, 0, 1]  # the fastest tier holding each block
    # a GPU match of 1 block: the tiers continue from block 1
    assert t.match(keys, 1, 6, keys[0], BS).tiers == [0, 1, 0, 1]
    # the chain broken in every tier (block 2 gone) stops there, though block 3 is cached
    disk.slot_of.pop(keys[2])
    assert len(t.match(keys, 0, 6, ROOT_KEY, BS)) == 2
    # a key stored under another parent is not this prefix's block
    other = tiers(cpu=8)
    other.tiers[0].store(keys[0], 999)
    assert len(other.match(keys, 0, 6, ROOT_KEY, BS)) == 0


def test_write_back_demotes_the_victim_before_its_slot_is_reused():
    t = tiers(cpu=2, disk=4, offload="write-back")
    keys, parents = chain(3)
    t.evicted([10, 11], keys[:2], parents[:2])  # GPU blocks 10, 11 evicted: cpu is full
    t.evicted([12], keys[2:], parents[2:])  # the cpu tier's LRU victim (key 1) goes to disk first
    pre, post = t.take_ops()
    assert post == []
    assert pre == [("gpu", 10, "cpu", 0), ("gpu", 11, "cpu", 1), ("cpu", 0, "disk", 0), ("gpu", 12, "cpu", 0)]
    assert t.tiers[1].slot_of == {keys[0]: 0} and set(t.tiers[0].slot_of) == {keys[1], keys[2]}


def test_write_through_stores_in_every_tier_after_the_forward_tail_first():
    t = tiers(cpu=2, disk=4)
    keys, parents = chain(3)
    t.stored([5, 6, 7], keys, parents)
    pre, post = t.take_ops()
    assert pre == []
    # cpu stores 3, then 2 (slots 0, 1), then 1 into the slot of its least recent block (3)
    assert post[:3] == [("gpu", 7, "cpu", 0), ("gpu", 6, "cpu", 1), ("gpu", 5, "cpu", 0)]
    assert [op[2] for op in post[3:]] == ["disk"] * 3
    # tail first: the prefix is the most recent, so a full cpu tier keeps the prefix (blocks 1, 2)
    assert set(t.tiers[0].slot_of) == {keys[0], keys[1]}
    t.evicted([1], [keys[0]], [ROOT_KEY])  # write-back only: nothing happens
    assert t.take_ops() == ([], [])


def test_a_slot_being_loaded_is_never_evicted_in_the_same_step():
    t = tiers(cpu=2, offload="write-back")
    keys, parents = chain(4)
    t.evicted([1, 2], keys[:2], parents[:2])
    t.take_ops()
    m = t.match(keys, 0, 4, ROOT_KEY, BS)
    assert len(m) == 2
    t.pin(m)
    t.evicted([3], [keys[2]], [parents[2]])  # every slot pinned: nothing is stored
    assert t.tiers[0].dropped_stores == 1
    t.loads(m, [20, 21])
    pre, _ = t.take_ops()
    assert pre == [("cpu", 0, "gpu", 20), ("cpu", 1, "gpu", 21)]
    t.evicted([3], [keys[2]], [parents[2]])  # unpinned now: the LRU slot makes room
    assert len(t.tiers[0]) == 2 and keys[2] in t.tiers[0].slot_of


def test_auto_loads_the_prefix_that_saves_the_most_time():
    t = tiers(cpu=8, disk=8, load="auto")
    keys, parents = chain(4)
    for j in (0, 1):
        t.tiers[0].store(keys[j], parents[j])
    for j in (2, 3):
        t.tiers[1].store(keys[j], parents[j])
    cpu_s, disk_s = BLOCK_BYTES / 50e9, BLOCK_BYTES / 7e9
    # recompute costs between the two: the cpu blocks are worth loading, the disk ones are not
    per_block = (cpu_s + disk_s) / 2
    t.recompute_s = lambda start, n, rest: n / BS * per_block
    m = t.match(keys, 0, 4, ROOT_KEY, BS)
    assert m.tiers == [0, 0] and m.declined == 2
    t.recompute_s = lambda start, n, rest: n / BS * disk_s * 2  # everything is worth loading
    assert len(t.match(keys, 0, 4, ROOT_KEY, BS)) == 4
    t.recompute_s = lambda start, n, rest: n / BS * cpu_s / 2  # nothing is
    assert len(t.match(keys, 0, 4, ROOT_KEY, BS)) == 0


# -- the engine --------------------------------------------------------------------------------
def test_an_evicted_block_asked_again_is_loaded_from_the_cpu_tier_at_its_bandwidth(tmp_path):
    _, s0, rows0, _ = run(tmp_path, evict_then_return(), "none")
    assert rows0.loc["r4", "cached_tokens"] == 0  # evicted from the pool: recomputed
    rp, s, rows, steps = run(tmp_path, evict_then_return(), "cpu", cpu_kv_mem="1GiB", load_policy="always")
    hit = 144  # 160 tokens: 9 whole blocks before the one holding the last prompt token
    assert rows.loc["r4", "cached_tokens"] == hit and rows.loc["r4", "loaded_tokens"] == hit
    assert s["hit_rate_cpu"] == pytest.approx(hit / sum(r.prompt_len for r in evict_then_return()))
    assert s["hit_rate_gpu"] == s0["prefix_hit_rate"] and s["hit_rate_disk"] is None
    step = steps[steps.bytes_loaded > 0]
    assert len(step) == 1 and int(step.bytes_loaded.iloc[0]) == 9 * BLOCK_BYTES
    assert step.load_ms.iloc[0] == pytest.approx(9 * BLOCK_BYTES / 50e9 * 1e3)
    assert s["bytes_loaded"] == 9 * BLOCK_BYTES and s["load_s"] == pytest.approx(9 * BLOCK_BYTES / 50e9)
    # write-through: every block computed was stored once (r4's loaded blocks are not stored again)
    computed = sum(-(-(r.prompt_len + r.output_len - 1) // BS) - (r.prompt_len + r.output_len - 1) % BS // BS
                   for r in evict_then_return())
    assert s["bytes_stored"] > 0 and s["bytes_stored"] % BLOCK_BYTES == 0
    assert s["bytes_stored"] // BLOCK_BYTES <= computed


@pytest.mark.parametrize("policy", sorted(set(CACHE_POLICIES) - {"learned"}))  # (learned needs its file)
def test_every_cache_policy_orders_a_tier(tmp_path, policy):
    """Any --cpu-cache-policy orders a tier: the evicted document comes back from it (a policy whose
    batch calls took a list but got an iterator crashed at the first step that loaded a block)."""
    _, s, rows, _ = run(tmp_path, evict_then_return(), "cpu", cpu_kv_mem="1GiB", load_policy="always",
                        cpu_cache_policy=policy)
    assert rows.loc["r4", "loaded_tokens"] == 144 and s["hit_rate_cpu"] > 0


def test_auto_loads_a_long_prompt_and_recomputes_a_short_one(tmp_path):
    """On an H200 a 96-token prefill of an 8B model is bound by reading the weights (the sim's matmul
    rate, 989.5 TFLOP/s x 0.667, matches its 4.24 TB/s weight stream at ~108 tokens): recomputing 80
    tokens adds nothing, less than moving 10.5 MB over PCIe (0.2 ms), so auto recomputes; a 4,096-token
    prefill is bound by FLOPs, where loading 4,080 tokens' KV (510 MB, 10 ms) beats recomputing them."""
    short = [req(0, 0.0, [("doc", 96)]), *(req(i, float(i), [(None, 300)]) for i in (1, 2, 3)),
             req(4, 10.0, [("doc", 96)])]
    _, s, rows, _ = run(tmp_path, short, "short", cpu_kv_mem="1GiB")
    assert rows.loc["r4", "loaded_tokens"] == 0 and s["tier_declined_tokens"] == 80
    long = [req(0, 0.0, [("doc", 4096)]), *(req(i, float(i), [(None, 4000)]) for i in (1, 2, 3)),
            req(4, 10.0, [("doc", 4096)])]
    _, s0, rows0, _ = run(tmp_path, long, "long0", num_blocks=300)
    _, s, rows, _ = run(tmp_path, long, "long", num_blocks=300, cpu_kv_mem="16GiB")
    assert rows0.loc["r4", "cached_tokens"] == 0 and rows.loc["r4", "loaded_tokens"] == 4080
    assert s["tier_declined_tokens"] == 0
    assert rows.loc["r4", "ttft_ms"] < rows0.loc["r4", "ttft_ms"] / 2  # 16 tokens computed, not 4,096


def test_the_sim_charges_loads_to_the_step_and_overlaps_write_through_stores():
    sim = make_sim(get_model("llama-3-8b"), get_gpu("h200"))
    sim.bind_pool(100, BS)
    sim.bind_tiers({"cpu": 50e9, "disk": 7e9}, {"cpu": 10, "disk": 10})
    base = StepBatch(block_size=BS, prefill_seq_ids=[1], prefill_starts=[0], prefill_lens=[512], prefill_last=[True])
    compute = sim.execute(base).duration_s
    loads = [("cpu", 0, "gpu", 5), ("disk", 1, "gpu", 6)]
    b = StepBatch(block_size=BS, prefill_seq_ids=[1], prefill_starts=[0], prefill_lens=[512], prefill_last=[True],
                  tier_pre=loads)
    r = sim.execute(b)
    assert r.tier_s == pytest.approx(BLOCK_BYTES / 50e9 + BLOCK_BYTES / 7e9)
    assert r.duration_s == pytest.approx(compute + r.tier_s)
    few = [("gpu", 5, "cpu", j) for j in range(2)]
    b.tier_pre, b.tier_post = [], few
    assert sim.execute(b).duration_s == pytest.approx(compute)  # hidden under the forward
    many = [("gpu", 5, "disk", j) for j in range(400)]
    b.tier_post = many
    assert sim.execute(b).duration_s == pytest.approx(400 * BLOCK_BYTES / 7e9)  # the link bounds the step


def test_auto_recomputes_when_the_tier_is_slower_than_prefill(tmp_path):
    _, s, rows, _ = run(tmp_path, evict_then_return(), "slow", cpu_kv_mem="1GiB", cpu_bw=0.001)
    assert rows.loc["r4", "cached_tokens"] == 0 and s["tier_declined_tokens"] == 144
    assert s["bytes_loaded"] == 0
    _, s2, rows2, _ = run(tmp_path, evict_then_return(), "always", cpu_kv_mem="1GiB", cpu_bw=0.001,
                          load_policy="always")
    assert rows2.loc["r4", "loaded_tokens"] == 144 and s2["tier_declined_tokens"] == 0
    assert rows2.loc["r4", "ttft_ms"] > rows.loc["r4", "ttft_ms"] + 1e3  # 18 MB at 1 MB/s


def test_write_back_serves_the_same_hits_from_blocks_the_pool_evicted(tmp_path):
    _, s, rows, _ = run(tmp_path, evict_then_return(), "wb", cpu_kv_mem="1GiB", offload="write-back",
                        load_policy="always")
    assert rows.loc["r4", "loaded_tokens"] == 144
    # only evicted blocks were stored: fewer than write-through stores (every computed block)
    _, s_wt, _, _ = run(tmp_path, evict_then_return(), "wt", cpu_kv_mem="1GiB", load_policy="always")
    assert 0 < s["bytes_stored"] < s_wt["bytes_stored"]


class ContentModel:
    """Stands in for the tensors: each GPU block and tier slot holds the key of the KV written into it.
    Carries out a step's transfers in their order, computes the registered blocks, and checks that a
    load reads the KV of the key its slot is indexed under, and that after the step every tier slot
    holds its key's KV."""

    def __init__(self, rp):
        self.kv = rp.kv
        self.inner = rp.executor.execute
        self.mem = {"gpu": {}, **{t.name: {} for t in rp.kv.tiers.tiers}}
        self.tier = {t.name: t for t in rp.kv.tiers.tiers}
        self.loads = 0
        rp.executor.execute = self

    def _move(self, ops, check_loads):
        mem = self.mem
        for src, i, dst, j in ops:
            val = mem[src].get(i)
            if dst == "gpu" and check_loads:
                assert val is not None and val == self.tier[src].key[i], "a load read the wrong KV"
                self.loads += 1
            mem[dst][j] = val

    def __call__(self, batch):
        pool = self.kv.pool
        self._move(batch.tier_pre, True)
        loaded = {j for _, _, dst, j in batch.tier_pre if dst == "gpu"}
        gpu = self.mem["gpu"]
        for b in range(pool.physical):  # the forward writes every registered block it did not load
            k = pool.key[b]
            if k is not None and b not in loaded:
                gpu[b] = k
        self._move(batch.tier_post, False)
        for name, t in self.tier.items():
            for s, k in enumerate(t.key):
                if k is not None:
                    assert self.mem[name].get(s) == k, f"{name} slot {s} does not hold its key's KV"
        return self.inner(batch)


def random_trace(seed, n=60):
    rnd = random.Random(seed)
    docs = [f"d{i}" for i in range(6)]
    out = []
    for i in range(n):
        segs = [(rnd.choice(docs), rnd.choice((32, 64, 96, 128)))]
        if rnd.random() < 0.5:
            segs.append((rnd.choice(docs) + "/tail", rnd.choice((16, 48))))
        segs.append((None, rnd.randrange(1, 40)))
        out.append(req(i, i * rnd.random() * 0.5, segs, out=rnd.randrange(2, 30), n=1 + (rnd.random() < 0.1)))
    return out


@pytest.mark.parametrize("offload", ["write-through", "write-back"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_transfer_moves_the_right_kv_and_every_slot_holds_its_key(tmp_path, offload, seed):
    reqs = random_trace(seed)
    cfg = ReplayConfig(executor="sim", model="llama-3-8b", block_size=BS, num_blocks=40, cpu_kv_mem=str(24 * BLOCK_BYTES),
                       disk_kv_mem=str(80 * BLOCK_BYTES), offload=offload, load_policy="always",
                       max_batched_tokens=128, cpu_cache_policy=random.Random(seed).choice(["lru", "fifo", "s3fifo"]))
    rp = Replay("<test>", cfg, str(tmp_path / "r"), requests=reqs)
    model = ContentModel(rp)
    s = rp.run()
    assert s["completed"] == len(reqs)
    # write-through fills a cpu tier smaller than the pool with blocks the pool still holds: its hits
    # come from disk; write-back keeps in the cpu tier what the pool let go
    assert model.loads > 0 and s["hit_rate_disk"] > 0 and (s["hit_rate_cpu"] > 0.05 or offload == "write-through")
    assert s["bytes_loaded"] == model.loads * BLOCK_BYTES
    counts = rp.kv.pool.recount()  # the pool's own invariants hold with tiers behind it
    assert counts["num_used"] == rp.kv.pool.num_used == 0
    for t in rp.kv.tiers.tiers:
        assert len(t.policy) == len(t.slot_of) and not t.pins
        assert all(t.key[s] == k for k, s in t.slot_of.items())


def test_tiers_never_lose_hits_the_pool_alone_makes(tmp_path):
    """A tier only adds: hits of the pool are the same with or without it, on the shipped chat trace
    (the pool's decisions do not depend on the tiers, write-through)."""
    from kvbench.trace.format import load_trace

    reqs = load_trace("traces/chat.jsonl", limit=120)
    base = Replay("traces/chat.jsonl", ReplayConfig(executor="sim", model="llama-3-8b", num_blocks=300),
                  str(tmp_path / "a"), requests=reqs).run()
    tiered = Replay("traces/chat.jsonl", ReplayConfig(executor="sim", model="llama-3-8b", num_blocks=300,
                                                      cpu_kv_mem="64GiB"), str(tmp_path / "b"), requests=reqs).run()
    assert tiered["prefix_hit_rate"] > base["prefix_hit_rate"]
    assert tiered["prefix_hit_rate"] <= tiered["ideal_hit_rate"] + 1e-12
    assert tiered["hit_rate_gpu"] + tiered["hit_rate_cpu"] == pytest.approx(tiered["prefix_hit_rate"])


def test_loaded_blocks_give_transformers_logits_on_the_model_executor():
    from kvbench.engine.selfcheck import run_engine_selfcheck

    r = run_engine_selfcheck(device="cpu", tiers=True)
    x = r["exercised"]
    assert x["cpu_hit_rate"] > 0 and x["disk_hit_rate"] > 0 and x["tier_bytes_loaded"] > 0
    assert r["ok"], (r["max_logit_diff"], r["greedy_agree"])


# -- options -----------------------------------------------------------------------------------
@pytest.mark.parametrize("args, field", [
    (["--cpu-kv-mem", "16GiB", "--prefix-mode", "radix"], "--cpu-kv-mem"),
    (["--disk-kv-mem", "1TiB", "--layout", "slab"], "--disk-kv-mem"),
    (["--cpu-kv-mem", "16GiB", "--no-prefix-cache"], "--cpu-kv-mem"),
    (["--cpu-kv-mem", "lots"], "--cpu-kv-mem"),
    (["--cpu-kv-mem", "16GiB", "--cpu-bw", "0"], "--cpu-bw"),
    (["--cpu-kv-mem", "16GiB", "--cpu-cache-policy", "mru"], "--cpu-cache-policy"),
    (["--cpu-kv-mem", "16GiB", "--offload", "sideways"], "--offload"),
    (["--cpu-kv-mem", "100"], "--cpu-kv-mem"),  # fewer bytes than one block
])
def test_bad_tier_options_exit_2_naming_the_option(tmp_path, capsys, args, field):
    with pytest.raises(SystemExit) as e:
        main(["replay", "traces/chat.jsonl", "--executor", "sim", "--limit", "3", "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert field in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_sweep_over_tier_sizes_collapses_what_a_run_without_tiers_does_not_use():
    off = collapse({**ReplayConfig().to_dict(), "cpu_kv_mem": "0", "offload": "write-back", "cpu_bw": 9.0})
    assert off["offload"] == "write-through" and off["cpu_bw"] == ReplayConfig().cpu_bw
    on = collapse({**ReplayConfig().to_dict(), "cpu_kv_mem": "128GiB", "offload": "write-back"})
    assert on["offload"] == "write-back"
    assert "disk_bw" in not_applicable({**ReplayConfig().to_dict(), "cpu_kv_mem": "128GiB"})
    assert "cpu_kv_mem" in not_applicable({**ReplayConfig().to_dict(), "layout": "slab"})


def test_replay_json_reports_each_tier(tmp_path, capsys):
    main(["replay", "traces/chat.jsonl", "--executor", "sim", "--model", "llama-3-8b", "--limit", "60",
          "--num-blocks", "400", "--cpu-kv-mem", "8GiB", "--disk-kv-mem", "64GiB", "--json",
          "--out", str(tmp_path / "o")])
    s = json.loads(capsys.readouterr().out)
    for key in ("hit_rate_gpu", "hit_rate_cpu", "hit_rate_disk", "bytes_loaded", "bytes_stored", "load_s"):
        assert s[key] is not None
    steps = pd.read_parquet(tmp_path / "o" / "steps.parquet")
    assert steps.bytes_loaded.sum() == s["bytes_loaded"] and steps.bytes_stored.sum() == s["bytes_stored"]
    assert steps.cpu_hit_tokens_cum.is_monotonic_increasing


def test_tier_hits_of_resumed_requests_are_counted_apart_as_the_pool_counts_them(tmp_path):
    """A preempted request resumed from the tiers is not a first lookup (spec §4): the tiers' hit rates
    add up to prefix_hit_rate, which counts first admissions only."""
    cfg = ReplayConfig(executor="sim", model="llama-3-8b", block_size=BS, num_blocks=16, cpu_kv_mem=str(64 * BLOCK_BYTES),
                       load_policy="always", max_batched_tokens=64)
    reqs = random_trace(1)
    s = Replay("<test>", cfg, str(tmp_path / "r"), requests=reqs).run()
    assert s["preemptions"] > 0 and s["resumed_loaded_tokens"] > 0 and s["hit_rate_cpu"] > 0
    rows = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    prompt = sum(r.prompt_len for r in reqs)
    assert s["hit_rate_cpu"] == pytest.approx(rows.loaded_tokens.sum() / prompt)
    assert s["hit_rate_gpu"] == pytest.approx((rows.cached_tokens - rows.loaded_tokens).sum() / prompt)


def test_the_report_stacks_each_tiers_hits_and_only_where_a_run_had_tiers(tmp_path):
    from kvbench.cli.replay import REPLAY_OPTIONS
    from kvbench.report.cluster_charts import tiers as tiers_chart
    from kvbench.report.data import load_inputs
    from kvbench.report.html import build_report
    from kvbench.sweep import parse_grid, run_sweep

    grid = parse_grid({"executor": "sim", "model": "llama-3-8b", "num_blocks": "300", "limit": "80",
                       "cpu_kv_mem": "0,512MiB,8GiB"}, REPLAY_OPTIONS)
    run_sweep("traces/chat.jsonl", grid, str(tmp_path / "sw"))
    build_report([str(tmp_path / "sw")], str(tmp_path / "rep"))
    assert len(list((tmp_path / "rep").glob("*-tiers.png"))) == 1
    (section,) = load_inputs([str(tmp_path / "sw")]).sections
    assert [r.label for r in section.runs] == ["no CPU tier", "CPU tier 512MiB", "CPU tier 8GiB"]
    fig = tiers_chart(section)
    bars = [p for p in fig.axes[0].patches]
    n = len(section.runs)
    gpu, cpu = bars[:n], bars[n:2 * n]  # one row per run, bottom-up order of y
    for r, g, c in zip(section.runs, gpu, cpu):
        assert g.get_width() == pytest.approx(100 * (r.metric("hit_rate_gpu") or r.metric("prefix_hit_rate")))
        assert c.get_width() == pytest.approx(100 * (r.metric("hit_rate_cpu") or 0.0))
        assert c.get_x() == pytest.approx(g.get_width())  # stacked
    assert section.runs[2].metric("hit_rate_cpu") > section.runs[1].metric("hit_rate_cpu") > 0
    # a group without tiers gets no tiers chart
    section.runs = section.runs[:1]
    assert tiers_chart(section) is None


def test_the_report_stacks_a_tiered_what_ifs_hits(tmp_path):
    from kvbench.report.whatif_charts import whatif_tiers
    from kvbench.report.data import load_inputs
    from kvbench.report.html import build_report

    main(["trace", "whatif", "traces/chat.jsonl", "--block-size", "16", "--model", "llama-3-8b",
          "--tiers", "gpu=512MiB,cpu=0,2GiB,disk=0,32GiB", "--policies", "lru", "--out", str(tmp_path / "wi")])
    build_report([str(tmp_path / "wi")], str(tmp_path / "rep"))
    assert "stacked by the tier that served it" in (tmp_path / "rep" / "index.html").read_text()
    (w,) = load_inputs([str(tmp_path / "wi")]).whatifs
    fig = whatif_tiers(w)
    df = w.table.sort_values(["policy", "gpu_bytes", "cpu_bytes", "disk_bytes"], kind="stable")
    n = len(df)
    bars = fig.axes[0].patches
    for k, key in enumerate(("hit_rate_gpu", "hit_rate_cpu", "hit_rate_disk")):
        widths = [b.get_width() for b in bars[k * n:(k + 1) * n]]
        assert widths == pytest.approx(list(100 * df[key]))
    assert {t.get_text() for t in fig.axes[0].get_yticklabels()} >= {"lru: gpu 512MiB", "lru: gpu 512MiB + cpu 2GiB"}
