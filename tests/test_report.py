"""``kvbench report``: a sweep, a single run, two traces, eviction runs and a what-if table give an
index.html with its charts; the page references nothing outside itself and renders in Chromium."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvbench.cli import main
from kvbench.cli.replay import REPLAY_OPTIONS
from kvbench.engine.config import ReplayConfig
from kvbench.engine.replay import replay
from kvbench.report.html import build_report
from kvbench.sweep import parse_grid, run_sweep

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
SECTION_PNGS = {"memory", "hit_rate", "concurrency", "latency", "timeline"}
SIM = dict(executor="sim", model="llama-3-8b", max_model_len=8192)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small chat sweep (4 paged + 1 slab), one agent run, one eviction run, one what-if table."""
    root = tmp_path_factory.mktemp("report-data")
    grid = parse_grid({"layout": "paged,slab", "block_size": "16,64", "prefix_cache": "on,off",
                       "executor": "sim", "model": "llama-3-8b", "max_model_len": "8192",
                       "kv_mem": "4GiB", "time_scale": "0.1", "limit": "40"}, REPLAY_OPTIONS)
    run_sweep(str(REPO / "traces/chat.jsonl"), grid, str(root / "sweep"))
    replay(str(REPO / "traces/agent.jsonl"), ReplayConfig(**SIM, limit=15), str(root / "agent-run"))
    # An eviction run, written as the engine will write one, from a real run's files: the report
    # must show its section from config.json and summary.json alone.
    ev = root / "agent-h2o"
    shutil.copytree(root / "agent-run", ev)
    config = json.loads((ev / "config.json").read_text())
    config["settings"].update(eviction="h2o", kv_budget=0.25)
    (ev / "config.json").write_text(json.dumps(config))
    summary = json.loads((ev / "summary.json").read_text())
    summary.update(evicted_tokens=12000, recalled_tokens=3000, attention_mass_kept=0.91)
    (ev / "summary.json").write_text(json.dumps(summary))
    wi = root / "whatif"
    wi.mkdir()
    budgets = 2.0 ** np.arange(26, 34)
    pd.DataFrame([{"budget_bytes": b, "budget_blocks": int(b // 2**21), "policy": p,
                   "hit_rate": min(0.9, 0.1 * k * (1.0 if p == "belady" else 0.8)), "ceiling": 0.93}
                  for p in ("lru", "fifo", "belady") for k, b in enumerate(budgets)]
                 ).to_parquet(wi / "whatif.parquet")
    return root


def _pngs(out: Path) -> set[str]:
    return {p.name for p in out.glob("*.png")}


@pytest.fixture(scope="module")
def sweep_report(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "sweep"
    build_report([str(data / "sweep")], str(out))
    return out


def test_report_of_a_sweep(sweep_report):
    assert _pngs(sweep_report) == {f"chat-{s}.png" for s in SECTION_PNGS}  # no eviction: no section
    page = (sweep_report / "index.html").read_text()
    assert page.count("<h2") == 1 and "Trace chat.jsonl" in page
    assert len(re.findall(r"<img [^>]*src='data:image/png;base64,", page)) == len(SECTION_PNGS)
    # the headline table comes first, with every configuration and its ratio to the slab
    assert page.index("Headline") < page.index("<figure")
    for name in ("paged-bs16-pc_on", "paged-bs64-pc_off", "slab"):
        assert f"<td class=name>{name}</td>" in page
    assert "× slab" in page and "1.00×" in page
    assert "llama-3-8b" in page and "git_commit" in page  # settings and versions


def test_report_of_a_single_run_via_cli(data, tmp_path, capsys):
    out = tmp_path / "one"
    main(["report", str(data / "agent-run"), "--out", str(out)])
    assert capsys.readouterr().out.strip() == str(out / "index.html")
    assert _pngs(out) == {f"agent-{s}.png" for s in SECTION_PNGS}
    page = (out / "index.html").read_text()
    assert "agent-run" in page and "× slab" not in page  # no baseline, no ratios


def test_two_traces_eviction_and_whatif(data, tmp_path):
    out = tmp_path / "all"
    rep = build_report([str(data)], str(out))  # a directory holding runs, a sweep and a what-if
    page = (out / "index.html").read_text()
    assert page.count("<h2 id='chat'>") == 1 and page.count("<h2 id='agent'>") == 1
    assert "agent-eviction.png" in rep.charts and "chat-eviction.png" not in rep.charts
    assert "whatif-1.png" in rep.charts and "What-if: whatif" in page
    assert {"h2o", "n/a"} <= set(re.findall(r"<td>([^<]*)</td>", page))


def test_bad_report_input_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "empty" in err[0]


EXTERNAL = [
    re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.I),  # remote or protocol-relative
    re.compile(r"<script\b[^>]*\bsrc\s*=", re.I),
    re.compile(r"<link\b[^>]*\brel\s*=\s*[\"']?stylesheet", re.I),
    re.compile(r"@import", re.I),
    re.compile(r"url\(\s*[\"']?\s*(?:https?:)?//", re.I),
    re.compile(r"<(?:iframe|object|embed)\b", re.I),
]


def test_page_references_nothing_outside_itself(sweep_report):
    page = (sweep_report / "index.html").read_text()
    for pattern in EXTERNAL:
        assert not pattern.search(page), pattern.pattern
    srcs = re.findall(r"""\bsrc\s*=\s*["']([^"']*)""", page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)


def _near(img: np.ndarray, hex_color: str, tol: float = 0.08) -> int:
    rgb = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img[..., :3] - rgb).max(axis=-1) < tol).sum())


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} missing: apt-get install chromium")
def test_chromium_renders_the_charts(sweep_report, tmp_path):
    from matplotlib.image import imread

    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                    "--window-size=1200,3000", (sweep_report / "index.html").resolve().as_uri()],
                   capture_output=True, timeout=120, check=True)
    img = imread(shot)  # float RGB(A) in [0, 1]
    assert img.shape[:2] == (3000, 1200)
    white = (img[..., :3].min(axis=-1) > 0.97).mean()
    assert white < 0.9, f"page is {white:.0%} white"
    colours = len(np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert colours > 200, f"only {colours} distinct colours"
    # The charts' own colours: matplotlib's blue and orange lines, the orange 'cached' stack.
    # Nothing else on the page (text, tables, links) is drawn in them, so they prove the images
    # were decoded and painted, not shown as broken-image icons.
    assert _near(img, "#1f77b4") > 2000 and _near(img, "#ff7f0e") > 1000
