"""Like-for-like with a real server: the replayed engine's max-model-len rule (vLLM's by default: an
output that does not fit is cut, not refused; SGLang's on request), and a serving engine's settings read from the server's own
start-up log or endpoints and given to the sim."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import replay

REPO = Path(__file__).resolve().parents[1]


def _trace(tmp_path: Path) -> Path:
    lines = [{"id": "fits", "t": 0, "output_len": 20, "prompt": [{"unique": 100}]},
             {"id": "long-output", "t": 0.1, "output_len": 100, "prompt": [{"unique": 100}]},
             {"id": "long-prompt", "t": 0.2, "output_len": 5, "prompt": [{"unique": 200}]},
             {"id": "at-limit", "t": 0.3, "output_len": 1, "prompt": [{"unique": 150}]},
             {"id": "one-short", "t": 0.4, "output_len": 9, "prompt": [{"unique": 149}]},
             {"id": "exact", "t": 0.5, "output_len": 10, "prompt": [{"unique": 140}]},
             {"id": "near", "t": 0.6, "output_len": 2, "prompt": [{"unique": 145}]}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _outputs(trace: Path, out: Path, **settings) -> tuple[dict, dict]:
    """(summary, id -> output tokens run, or the refusal) of a replay at max-model-len 150."""
    summary = replay(str(trace), ReplayConfig(max_model_len=150, **settings), str(out))
    rows = pd.read_parquet(out / "requests.parquet").set_index("id")
    return summary, {i: (r["rejected"] if isinstance(r["rejected"], str) else int(r["output_tokens"]))
                     for i, r in rows.iterrows()}


def test_the_length_rule_is_the_replayed_engines(tmp_path):
    trace = _trace(tmp_path)
    # vLLM's by default: a prompt of the limit or longer refused, any shorter one's output cut at the limit
    summary, got = _outputs(trace, tmp_path / "vllm")
    assert got == {"fits": 20, "long-output": 50, "long-prompt": "max_model_len", "at-limit": "max_model_len",
                   "one-short": 1, "exact": 10, "near": 2}
    assert (summary["completed"], summary["rejected"], summary["truncated"]) == (5, 2, 2)
    assert _outputs(trace, tmp_path / "truncate", overlong="truncate")[1] == got  # the rule's old name
    # SGLang's: prompt + output over the limit refused; a prompt within 6 of it refused by the scheduler;
    # the output capped at limit - prompt - 2
    summary, got = _outputs(trace, tmp_path / "sglang", overlong="sglang")
    assert got == {"fits": 20, "long-output": "max_model_len", "long-prompt": "max_model_len",
                   "at-limit": "max_model_len", "one-short": "max_model_len", "exact": 8, "near": "max_model_len"}
    assert (summary["completed"], summary["rejected"], summary["truncated"]) == (2, 5, 1)
    summary, got = _outputs(trace, tmp_path / "reject", overlong="reject")
    assert got == {"fits": 20, "long-output": "max_model_len", "long-prompt": "max_model_len",
                   "at-limit": "max_model_len", "one-short": "max_model_len", "exact": 10, "near": 2}
    assert (summary["completed"], summary["rejected"], summary["truncated"]) == (3, 4, 0)


LOG = REPO / "tests" / "data" / "live" / "vllm-0.32-startup.log"


def test_the_sim_takes_a_servers_settings_from_its_start_up_log(tmp_path, capsys):
    """--like-server: the block size, pool (vLLM's null block left out), sequence cap, token budget,
    max length and prefix caching of the server in the recorded log; an option given explicitly wins."""
    from kvbench.cli import main

    main(["replay", str(REPO / "traces" / "chat.jsonl"), "--limit", "5", "--model", "tiny", "--like-server", str(LOG),
          "--max-num-seqs", "64", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert "kvbench: like the server (vllm 0.32.0" in err and "--num-blocks 255" in err
    s = json.loads((tmp_path / "r" / "config.json").read_text())["settings"]
    assert (s["block_size"], s["num_blocks"], s["max_batched_tokens"], s["max_model_len"]) == (32, 255, 2048, 4096)
    assert s["max_num_seqs"] == 64 and s["prefix_cache"] is True and s["overlong"] == "vllm"
