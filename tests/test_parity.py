"""Like-for-like with a real server: vLLM's max-model-len rule (an output that does not fit is cut,
not refused) as an option of the sim, and a serving engine's settings read from the server's own
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
             {"id": "long-prompt", "t": 0.2, "output_len": 5, "prompt": [{"unique": 200}]}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_overlong_outputs_are_cut_as_vllms_server_does_or_refused(tmp_path):
    trace = _trace(tmp_path)
    cut = replay(str(trace), ReplayConfig(max_model_len=150, overlong="truncate"), str(tmp_path / "cut"))
    rows = pd.read_parquet(tmp_path / "cut" / "requests.parquet").set_index("id")
    assert rows.loc["long-output", "output_tokens"] == 50 and pd.isna(rows.loc["long-output", "rejected"])
    assert rows.loc["fits", "output_tokens"] == 20
    assert rows.loc["long-prompt", "rejected"] == "max_model_len"  # a prompt that does not fit: refused
    assert (cut["completed"], cut["rejected"], cut["truncated"]) == (2, 1, 1)
    refused = replay(str(trace), ReplayConfig(max_model_len=150), str(tmp_path / "refuse"))
    assert (refused["completed"], refused["rejected"], refused["truncated"]) == (1, 2, 0)


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
    assert s["max_num_seqs"] == 64 and s["prefix_cache"] is True and s["overlong"] == "truncate"
