"""Bad input never crashes, never hangs, never writes garbage: every case gets one line on stderr
naming the file (and line and field) or the option, and exit code 2; no traceback, a bounded time and
bounded memory. A corpus of one example per class of failure, then a fuzz (hypothesis) of malformed
traces, importer rows, option values and broken result directories. The cases run in one worker
process (tests/cli_worker.py) so hundreds of them take seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"id": "a", "t": 0, "output_len": 4, "prompt": [{"shared": "sys", "len": 40}, {"unique": 8}]}
MAX_RSS_MB = 1500  # the worker's peak over every case


class Worker:
    def __init__(self):
        env = {**os.environ, "KVBENCH_CASE_TIMEOUT_S": "30"}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "cli_worker.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=ROOT)

    def run(self, argv: list[str], cwd: Path) -> dict:
        self.proc.stdin.write(json.dumps({"argv": [str(a) for a in argv], "cwd": str(cwd)}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the worker died on {argv}"
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def check_refused(r: dict, *fragments: str) -> None:
    """Exit 2, one line on stderr containing every fragment, no traceback, no output on stdout."""
    assert r["traceback"] is None, r["traceback"]
    assert r["code"] == 2, (r["code"], r["stderr"][-500:])
    lines = r["stderr"].strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r["stderr"], r["stderr"][-500:]
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert r["seconds"] < 30 and r["peak_rss_mb"] < MAX_RSS_MB, (r["seconds"], r["peak_rss_mb"])


def check_sane(r: dict) -> None:
    """Accepted (exit 0) or refused properly: never a traceback, a hang or a run error."""
    assert r["traceback"] is None, r["traceback"]
    if r["code"] != 0:
        check_refused(r)
    assert r["peak_rss_mb"] < MAX_RSS_MB


def trace_with(line: str, tmp: Path, name: str = "t.jsonl") -> Path:
    p = tmp / name
    p.write_text(json.dumps(GOOD) + "\n" + line + "\n", encoding="utf-8", errors="surrogatepass")
    return p


# ------------------------------------------------------------------------- one case per class

def _req(**kw) -> str:
    return json.dumps({**GOOD, "id": "b", **kw})


CORPUS = [
    # (class, a line 2 of a trace, fragments of the message)
    ("deep nesting", '{"id": "b", "t": 0, "output_len": 1, "prompt": [{"unique": 1}], "meta": '
     + '{"a": ' * 50_000 + "1" + "}" * 50_001, [":2:", "nested too deeply"]),
    ("integer over 4,300 digits", '{"id": "b", "t": ' + "9" * 5000 + ', "output_len": 1, "prompt": [{"unique": 1}]}',
     [":2:", "4300 digits"]),
    ("t too large for a float", '{"id": "b", "t": 1' + "0" * 400 + ', "output_len": 1, "prompt": [{"unique": 1}]}',
     [":2:", "field 't'", "at most"]),
    ("NaN", '{"id": "b", "t": NaN, "output_len": 1, "prompt": [{"unique": 1}]}', [":2:", "NaN"]),
    ("lone surrogate in an id", '{"id": "\\ud800", "t": 0, "output_len": 1, "prompt": [{"unique": 1}]}',
     [":2:", "field 'id'", "surrogate"]),
    ("lone surrogate in a session", _req(session="\udfff"), [":2:", "field 'session'"]),
    ("lone surrogate in a stream name", _req(prompt=[{"shared": "x\udc80", "len": 4}]), [":2:", "prompt[0].shared"]),
    ("lone surrogate in text", _req(prompt=[{"text": "hi \ud800"}]), [":2:", "prompt[0].text"]),
    ("a segment of 2e9 tokens", _req(prompt=[{"unique": 2_000_000_000}]), [":2:", "prompt[0].unique", "at most"]),
    ("a shared stream of 1e9 tokens", _req(prompt=[{"shared": "big", "len": 10**9}]), [":2:", "prompt[0].len"]),
    ("output_len 1e12", _req(output_len=10**12), [":2:", "field 'output_len'"]),
    ("n too large", _req(n=10**6), [":2:", "field 'n'"]),
]


@pytest.mark.parametrize("cls,line,fragments", CORPUS, ids=[c[0] for c in CORPUS])
def test_corpus_trace_lines(worker, tmp_path, cls, line, fragments):
    path = trace_with(line, tmp_path)
    check_refused(worker.run(["trace", "inspect", path], tmp_path), str(path), *fragments)


def test_corpus_dev_zero_is_bounded(worker, tmp_path):
    check_refused(worker.run(["trace", "inspect", "/dev/zero"], tmp_path), "/dev/zero:1:", "longer than")


TRACE = str(ROOT / "traces" / "chat.jsonl")
OPTIONS = [
    (["--time-scale", "inf"], "--time-scale"), (["--time-scale", "nan"], "--time-scale"),
    (["--kv-budget", "inf"], "--kv-budget"), (["--kv-budget", "1.5"], "--kv-budget"),
    (["--num-blocks", str(10**9 * 10**3)], "--num-blocks"), (["--block-size", "1000000"], "--block-size"),
    (["--kv-mem", "nan"], "--kv-mem"), (["--kv-mem", "-1GiB"], "--kv-mem"), (["--seed", "-1"], "--seed"),
    (["--watermark", "1"], "--watermark"), (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--model", "no-such-model"], "--model"), (["--gpu", "h999"], "--gpu"),
    (["--layout", "ring"], "--layout"),
]


@pytest.mark.parametrize("opts,flag", OPTIONS, ids=[" ".join(o) for o, _ in OPTIONS])
def test_corpus_replay_options(worker, tmp_path, opts, flag):
    r = worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--out", tmp_path / "r", *opts], tmp_path)
    check_refused(r, flag)
    assert not (tmp_path / "r").exists()  # refused before anything was written


@pytest.mark.parametrize("opts,flag", [(["trace", "gen", "chat", "--rate", "nan"], "--rate"),
                                       (["trace", "gen", "agent", "--think-s", "inf"], "--think-s"),
                                       (["trace", "gen", "rag", "--requests", "100000000000"], "--requests"),
                                       (["trace", "whatif", TRACE, "--warmup", "nan"], "--warmup"),
                                       (["trace", "whatif", TRACE, "--budgets", ""], "--budgets"),
                                       (["trace", "whatif", TRACE, "--policies", ""], "--policies"),
                                       (["trace", "whatif", TRACE, "--policies", "lru,"], "--policies"),
                                       (["replay", TRACE, "--metadata", "no-equals-sign"], "--metadata"),
                                       (["export", "/"], "/")])
def test_corpus_other_commands_options(worker, tmp_path, opts, flag):
    r = worker.run([*opts, *(["-o", tmp_path / "x.jsonl"] if "gen" in opts else [])], tmp_path)
    check_refused(r, flag)
    assert not (tmp_path / "x.jsonl").exists()


def test_corpus_calibration_files(worker, tmp_path):
    for name, text in [("list.json", "[1, 2]"), ("bin.json", "\x00\xff\xfe"), ("nan.json", '{"mem_bw": NaN}'),
                       ("inf.json", '{"matmul_flops": 1e400}'), ("unknown.json", '{"kind": "linear", "speed": 3}')]:
        p = tmp_path / name
        p.write_bytes(text.encode("latin-1"))
        r = worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--calibration", p,
                        "--out", tmp_path / name.replace(".", "-")], tmp_path)
        check_refused(r, str(p))


def test_corpus_model_folder_config(worker, tmp_path):
    for name, cfg in [("zero-heads", {"hidden_size": 64, "num_attention_heads": 0, "num_hidden_layers": 2,
                                      "vocab_size": 100, "intermediate_size": 128}),
                      ("strings", {"hidden_size": "big", "num_attention_heads": 4, "num_hidden_layers": 2,
                                   "vocab_size": 100, "intermediate_size": 128}),
                      ("rope-string", {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                                       "vocab_size": 100, "intermediate_size": 128, "rope_theta": "abc"}),
                      ("no-head-dim", {"hidden_size": 2, "num_attention_heads": 4, "num_hidden_layers": 2,
                                       "vocab_size": 100, "intermediate_size": 128}),
                      ("list", [1, 2, 3])]:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        r = worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--model", d,
                        "--out", tmp_path / f"r-{name}"], tmp_path)
        check_refused(r, "config.json")
    d = tmp_path / "binary"
    d.mkdir()
    (d / "config.json").write_bytes(b"\x00\x01\xff")
    check_refused(worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--model", d,
                              "--out", tmp_path / "r-bin"], tmp_path), "config.json")


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "tests" / "data" / "models").glob("*.json")))
def test_corpus_configs_kvbench_cannot_represent(worker, tmp_path, name):
    """A Mamba or linear-attention layer, an unknown layer type or quantization, a window <= 0 or longer
    than the model: refused naming the file and the field (each file's ``_refused_field``)."""
    path = ROOT / "tests" / "data" / "models" / f"{name}.json"
    field = json.loads(path.read_text())["_refused_field"]
    r = worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--model", path,
                    "--out", tmp_path / "r"], tmp_path)
    check_refused(r, f"{name}.json", field)


@pytest.mark.parametrize("extra,flag", [
    (["--prefix-mode", "radix"], "--prefix-mode"),
    (["--eviction", "h2o"], "--eviction"), (["--cpu-kv-mem", "1GiB"], "--cpu-kv-mem"),
    (["--cache-policy", "belady"], "--cache-policy")])
def test_what_a_hybrid_model_cannot_run_is_refused(worker, tmp_path, extra, flag):
    """gpt-oss keeps its KV in two groups: what kvbench does not model for groups says so, naming the
    option and the way out (--disable-hybrid-kv-cache-manager), before the run."""
    r = worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--model", "gpt-oss-120b", *extra,
                    "--out", tmp_path / "r"], tmp_path)
    check_refused(r, flag, "sliding 128 x 18, full x 18", "--disable-hybrid-kv-cache-manager")
    r = worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--model", "gpt-oss-120b", *extra,
                    "--disable-hybrid-kv-cache-manager", "--out", tmp_path / "r2"], tmp_path)
    assert r["code"] == 0, r["stderr"][-300:]
    check_refused(worker.run(["trace", "whatif", TRACE, "--model", "gemma-3-27b", "--budgets", "1GiB",
                              "--policies", "arc"], tmp_path), "--policies", "sliding 1024 x 9")


def test_model_executor_refuses_what_its_device_cannot_hold(worker, tmp_path):
    """Weights and pool that cannot fit the device the model executor would use: one line, exit 2,
    before anything is allocated (not an out-of-memory kill minutes later)."""
    for extra, field in ((["--model", "llama-3-70b"], "--model"), (["--kv-mem", "900TiB"], "--kv-mem")):
        r = worker.run(["replay", TRACE, "--executor", "model", "--device", "cpu", "--limit", "2", *extra,
                        "--out", tmp_path / field.strip("-")], tmp_path)
        check_refused(r, field, "do not fit")
        r = worker.run(["sweep", TRACE, "--executor", "model", "--device", "cpu", "--limit", "2", *extra,
                        "--out", tmp_path / ("sweep" + field)], tmp_path)
        check_refused(r, field, "do not fit")


def test_model_config_nulls_read_as_absent(worker, tmp_path):
    """An explicit null in a config.json is the field left out (transformers writes them), never a crash."""
    d = tmp_path / "nulls"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
        "intermediate_size": 128, "num_key_value_heads": None, "num_experts": 4, "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": None}))
    r = worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--model", d, "--out", tmp_path / "r"], tmp_path)
    assert r["traceback"] is None and r["code"] == 0, r["stderr"][-300:]


def test_model_executor_refuses_a_mixture_of_experts(worker, tmp_path):
    """Its forward is dense: it would run, and calibrate, the wrong model."""
    d = tmp_path / "moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
        "intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}))
    check_refused(worker.run(["replay", TRACE, "--executor", "model", "--device", "cpu", "--limit", "2",
                              "--model", d, "--out", tmp_path / "r"], tmp_path), "--model", "mixture of experts")
    check_refused(worker.run(["calibrate", "--device", "cpu", "--quick", "--model", d, "-o", tmp_path / "c.json"],
                             tmp_path), "--model", "mixture of experts")


def test_calibrate_refuses_an_output_path_before_measuring(worker, tmp_path):
    r = worker.run(["calibrate", "--device", "cpu", "--quick", "--repeats", "1", "-o", tmp_path / "no" / "c.json"],
                   tmp_path)
    check_refused(r, "--out", "not a writable directory")  # up front: after measuring it was a traceback


def test_corpus_importers(worker, tmp_path):
    cases = [
        ("mooncake", "m.jsonl", '{"timestamp": 1e400, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n',
         ["m.jsonl:1:", "timestamp"]),
        ("mooncake", "m2.jsonl", '{"timestamp": 0, "input_length": 1000000000000, "output_length": 5, "hash_ids": [1]}\n',
         ["m2.jsonl:1:", "input_length"]),
        ("azure", "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nNaN,10,5\n", ["a.csv:2:", "TIMESTAMP"]),
        ("azure", "a2.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,1e12,5\n", ["a2.csv:2:", "ContextTokens"]),
        ("burstgpt", "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                              "inf,x,1,1,2,Conversation log\n", ["b.csv:2:", "Timestamp"]),
        ("sharegpt", "s.json", json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "hi"}]}]),
         ["s.json", "no conversation"]),
        ("sharegpt", "deep.json", "[" * 100_000 + "]" * 100_000, ["deep.json", "nested too deeply"]),
        ("sharegpt", "digits.json", '[{"id": ' + "9" * 5000 + ', "conversations": []}]',
         ["digits.json", "unusable JSON", "4300 digits"]),
    ]
    for fmt, name, text, fragments in cases:
        p = tmp_path / name
        p.write_text(text)
        out = tmp_path / f"{name}.out.jsonl"
        check_refused(worker.run(["trace", "convert", "--from", fmt, p, "-o", out], tmp_path), *fragments)
        assert not out.exists()


def test_corpus_output_paths(worker, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    afile = tmp_path / "afile"
    afile.write_text("x")
    try:
        for out in (afile / "run", ro / "run") if os.geteuid() != 0 else (afile / "run",):
            check_refused(worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--out", out], tmp_path),
                          "--out")
            check_refused(worker.run(["sweep", TRACE, "--executor", "sim", "--limit", "2", "--out", out], tmp_path),
                          "--out")
            check_refused(worker.run(["trace", "whatif", TRACE, "--budget-blocks", "100", "--out", out], tmp_path),
                          "--out")
        run = tmp_path / "run"
        assert worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--out", run], tmp_path)["code"] == 0
        check_refused(worker.run(["report", run, "--out", afile / "rep"], tmp_path), "--out")
        # an explicit --out that holds a run is refused, unless --force
        check_refused(worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--out", run], tmp_path),
                      "--out", "--force")
        assert worker.run(["replay", TRACE, "--executor", "sim", "--limit", "2", "--out", run, "--force"],
                          tmp_path)["code"] == 0
    finally:
        ro.chmod(0o700)


def test_two_replays_in_the_same_second_write_two_directories(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-m", "kvbench", "replay", TRACE, "--executor", "sim",
                               "--limit", "3", "--json"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    dirs = {json.loads(p.communicate(timeout=120)[0])["run_dir"] for p in procs}
    assert len(dirs) == 2
    for d in dirs:
        assert json.loads((tmp_path / d / "summary.json").read_text())["complete"] is True


def test_sweep_checks_model_gpu_calibration_before_any_run(worker, tmp_path):
    for opts, flag in ((["--model", "tiny,nope"], "--model"), (["--gpu", "h200,h999"], "--gpu"),
                       (["--calibration", tmp_path / "missing.json"], "--calibration")):
        out = tmp_path / f"sw{flag}"
        check_refused(worker.run(["sweep", TRACE, "--executor", "sim", "--limit", "2", "--out", out, *opts],
                                 tmp_path), flag)
        assert not out.exists()


def test_summary_and_json_have_no_nan(worker, tmp_path):
    # every request rejected: no latency at all
    r = worker.run(["replay", TRACE, "--executor", "sim", "--limit", "3", "--max-model-len", "10",
                    "--out", tmp_path / "r", "--json"], tmp_path)
    assert r["code"] == 0, r["stderr"]
    for text in (r["stdout"], (tmp_path / "r" / "summary.json").read_text()):
        assert "NaN" not in text and "Infinity" not in text
        data = json.loads(text)
        assert data["ttft_ms_p50"] is None and data["completed"] == 0


# ----------------------------------------------------------------------- broken results, report

def _run_dir(worker, tmp_path: Path, name: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    d = tmp_path / name
    r = worker.run(["replay", TRACE, "--executor", "sim", "--model", "llama-3-8b", "--limit", "3", "--out", d], tmp_path)
    assert r["code"] == 0, r
    return d


BREAKS = {
    "summary a list": ("summary.json", b"[1, 2]"),
    "summary truncated": ("summary.json", b'{"complete": tr'),
    "a figure of the wrong type": ("summary.json", b'{"complete": true, "output_tok_per_s": "fast"}'),
    "a list where a figure belongs": ("summary.json", b'{"complete": true, "ttft_ms_p50": [1, 2]}'),
    "config without settings": ("config.json", b'{"trace": {}}'),
    "steps empty": ("steps.parquet", b""),
    "steps truncated": ("steps.parquet", None),
    "requests not parquet": ("requests.parquet", b"PAR1 nonsense"),
}


@pytest.mark.parametrize("what", list(BREAKS))
def test_report_over_a_broken_run_skips_it_or_stops(worker, tmp_path, what):
    good = _run_dir(worker, tmp_path / "runs", "good")
    bad = _run_dir(worker, tmp_path / "runs", "bad")
    name, content = BREAKS[what]
    path = bad / name
    path.write_bytes(path.read_bytes()[:100] if content is None else content)
    r = worker.run(["report", tmp_path / "runs", "--out", tmp_path / "rep"], tmp_path)
    assert r["code"] == 0 and r["traceback"] is None
    assert str(path) in r["stderr"] and "left out" in r["stderr"]
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "good" in page
    check_refused(worker.run(["report", tmp_path / "runs", "--out", tmp_path / "rep2", "--on-bad-run", "stop"],
                             tmp_path), str(path))
    assert good.exists()


# ------------------------------------------------------------------------------------ the fuzz

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.sampled_from([10**400, -1, 0, 2**31])
    | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(["NaN", "Infinity", "1e400"])
    | st.text(max_size=8) | st.sampled_from(["\ud800", "\udfff", ""]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
FIELDS = ["id", "t", "output_len", "prompt", "n", "session", "output", "meta"]
SEG_FIELDS = ["unique", "shared", "len", "tokens", "text"]


def _mutate(draw) -> str:
    """A trace line: the good request with one field or one segment field replaced, dropped, or the
    line mangled as text."""
    req = json.loads(json.dumps(GOOD))
    how = draw(st.sampled_from(["field", "segment", "drop", "text", "raw"]))
    if how == "field":
        req[draw(st.sampled_from(FIELDS))] = draw(JSONISH)
    elif how == "segment":
        req["prompt"][draw(st.integers(0, 1))][draw(st.sampled_from(SEG_FIELDS))] = draw(JSONISH)
    elif how == "drop":
        req.pop(draw(st.sampled_from(FIELDS)), None)
    req["id"] = req.get("id", "b") if req.get("id") != "a" else "b"
    line = json.dumps(req, ensure_ascii=False).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")
    line = line.replace('"1e400"', "1e400")
    if how == "text":
        cut = draw(st.integers(0, len(line)))
        line = line[:cut] + draw(st.text(max_size=4)) + line[cut:]
    elif how == "raw":
        line = draw(st.text(max_size=40))
    return line


TRACE_LINES = st.composite(lambda draw: _mutate(draw))()


@settings(max_examples=int(os.environ.get("KVBENCH_FUZZ_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(line=TRACE_LINES)
def test_fuzz_trace_lines(worker, tmp_path, line):
    path = trace_with(line, tmp_path)
    r = worker.run(["trace", "inspect", path, "--json"], tmp_path)
    check_sane(r)
    if r["code"] == 2:
        assert str(path) in r["stderr"]


OPTION_VALUES = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e30", "1e400", "", "x", "99999999999999999999",
                                 "0.5", "1", "16", "1.5", "abc,def", "8GiB", "-8GiB", "1e30GiB"])
REPLAY_FLAGS = ["--block-size", "--kv-budget", "--sink-tokens", "--kv-mem", "--num-blocks", "--max-num-seqs",
                "--max-batched-tokens", "--max-model-len", "--time-scale", "--limit", "--seed", "--watermark",
                "--layout", "--cache-policy", "--eviction", "--prefix-mode", "--admission", "--kv-dtype", "--gpu"]


@settings(max_examples=int(os.environ.get("KVBENCH_FUZZ_EXAMPLES", "150")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(REPLAY_FLAGS), value=OPTION_VALUES, command=st.sampled_from(["replay", "sweep"]))
def test_fuzz_replay_and_sweep_options(worker, tmp_path, flag, value, command):
    out = tmp_path / "out"
    r = worker.run([command, TRACE, "--executor", "sim", "--model", "llama-3-8b", "--limit", "2",
                    flag, value, "--out", out, *(["--force"] if command == "replay" else [])], tmp_path)
    check_sane(r)
    if r["code"] == 2 and command == "replay":
        assert flag in r["stderr"] or "kvbench replay" in r["stderr"], r["stderr"]


@settings(max_examples=int(os.environ.get("KVBENCH_FUZZ_EXAMPLES", "150")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(row=st.fixed_dictionaries({"timestamp": JSONISH, "input_length": JSONISH, "output_length": JSONISH,
                                  "hash_ids": JSONISH}), drop=st.sampled_from([None, "timestamp", "hash_ids"]))
def test_fuzz_mooncake_rows(worker, tmp_path, row, drop):
    if drop:
        row.pop(drop)
    p = tmp_path / "m.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [7]}\n'
                 + json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8", errors="surrogatepass")
    out = tmp_path / "m.out.jsonl"
    r = worker.run(["trace", "convert", "--from", "mooncake", p, "-o", out], tmp_path)
    check_sane(r)
    if r["code"] == 0:  # what an importer writes, kvbench reads
        check_sane(worker.run(["trace", "inspect", out], tmp_path))
        assert worker.run(["trace", "inspect", out], tmp_path)["code"] == 0
    out.unlink(missing_ok=True)


@settings(max_examples=int(os.environ.get("KVBENCH_FUZZ_EXAMPLES", "150")) // 3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cells=st.lists(st.sampled_from(["0", "1", "-1", "nan", "inf", "1e400", "1e12", "2023-11-16 18:15:46.6805900",
                                       "x", "", "3.5", "99999999999999999999999"]), min_size=3, max_size=3))
def test_fuzz_azure_rows(worker, tmp_path, cells):
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n" + ",".join(cells) + "\n")
    out = tmp_path / "a.out.jsonl"
    r = worker.run(["trace", "convert", "--from", "azure", p, "-o", out], tmp_path)
    check_sane(r)
    if r["code"] == 0:
        assert worker.run(["trace", "inspect", out], tmp_path)["code"] == 0
    out.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def two_runs(worker, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("pristine")
    for name in ("r", "ok"):
        _run_dir(worker, tmp / "runs", name)
    return tmp / "runs"


@settings(max_examples=int(os.environ.get("KVBENCH_FUZZ_EXAMPLES", "150")) // 10, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["summary.json", "config.json", "steps.parquet", "requests.parquet"]),
       content=st.binary(max_size=200) | st.sampled_from([b"[]", b"{}", b"null", b'{"settings": 3}']))
def test_fuzz_broken_run_directories(worker, two_runs, tmp_path_factory, name, content):
    import shutil

    tmp = tmp_path_factory.mktemp("rep")
    shutil.copytree(two_runs, tmp / "runs")
    d = tmp / "runs" / "r"
    (d / name).write_bytes(content)
    for on_bad in ("skip", "stop"):
        r = worker.run(["report", tmp / "runs", "--out", tmp / f"rep-{on_bad}", "--on-bad-run", on_bad], tmp)
        check_sane(r)
        assert r["code"] == 0 or str(d) in r["stderr"]


@pytest.mark.slow
def test_fuzz_at_length():
    """The fuzz above with ten times the examples (the default run keeps a few hundred)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "fuzz"],
                       cwd=ROOT, capture_output=True, text=True, timeout=3600,
                       env={**os.environ, "KVBENCH_FUZZ_EXAMPLES": "1500"})
    assert r.returncode == 0, r.stdout[-3000:]


def test_token_ids_outside_the_models_vocabulary_are_refused(worker, tmp_path):
    """The model executor embeds every id: a local model whose vocabulary is smaller than the ids
    kvbench draws, or a literal id past the vocabulary, is one line naming --model or the trace line
    (it was an IndexError mid-run)."""
    d = tmp_path / "small-vocab"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
        "intermediate_size": 512}))
    check_refused(worker.run(["replay", TRACE, "--executor", "model", "--device", "cpu", "--limit", "2",
                              "--model", d, "--out", tmp_path / "r"], tmp_path), "--model", "vocabulary")
    trace = tmp_path / "ids.jsonl"
    trace.write_text('{"t": 0, "output_len": 1, "prompt": [{"tokens": [5, 6]}]}\n'
                     '{"t": 1, "output_len": 1, "prompt": [{"tokens": [5, 40000]}]}\n')
    r = worker.run(["replay", trace, "--executor", "model", "--device", "cpu", "--out", tmp_path / "r2"], tmp_path)
    check_refused(r, "ids.jsonl:2:", "prompt[0].tokens")
    r = worker.run(["replay", trace, "--executor", "sim", "--out", tmp_path / "r3"], tmp_path)  # the sim embeds nothing
    assert r["code"] == 0, r["stderr"][-300:]
