"""What a user sees in a terminal: help for a bare command group, tables that stay whole at 80 columns
and when piped, the run saying what it runs, and the exact one-line messages for the mistakes people
make first (a raw Mooncake/Azure/ShareGPT file, more samples than --max-num-seqs, an empty list)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.cli import main
from kvbench.cli.console import Column, print_table

REPO = Path(__file__).resolve().parents[1]
CHAT = REPO / "traces" / "chat.jsonl"
REAL = REPO.parent / "shared" / "traces" / "real"


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv", [[], ["trace"], ["trace", "gen"]])
def test_a_bare_group_prints_its_help_and_exits_0(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 0 and err == ""
    assert out.startswith(f"Usage: kvbench {' '.join(argv)}".rstrip() + " [OPTIONS] COMMAND")
    assert "\\n" not in out and "Commands:" in out


class _Tty(io.StringIO):
    def isatty(self):
        return True


COLUMNS = [Column("run", right=False), Column("vs slab", right=False)] + [
    Column(x) for x in ("tok/s", "TTFT p50 ms", "E2E p50 ms", "hit rate", "int. frag", "KV util",
                        "mean running", "preempt")] + [Column("status", right=False)]
ROWS = [["paged-bs16-pc_on", "layout + prefix cache", "2521", "18.0", "1930", "0.850", "0.009", "0.345",
         "26.3", "0", "done"],
        ["paged-bs16-pc_off", "layout", "1865", "2500.1", "9876", "0.000", "0.004", "0.796", "26.1", "3", "done"],
        ["slab", "baseline", "845", "24300.4", "19301", "-", "0.749", "0.243", "7.8", "0", "done"]]


def test_a_wide_table_at_80_columns_cuts_no_cell():
    out = _Tty()
    print_table("kvbench sweep -> runs/x", COLUMNS, ROWS, caption="charts: kvbench report runs/x", file=out,
                width=80)
    text = out.getvalue()
    assert "…" not in text
    assert all(len(line) <= 80 for line in _plain(text).splitlines())
    lines = _plain(text).splitlines()
    for row in ROWS:  # every cell whole, and each configuration's cells under its own name
        at = lines.index(row[0])
        block = []
        for line in lines[at + 1:]:
            if not line.startswith(" "):
                break
            block.append(line)
        block_text = " · ".join(x.strip() for x in block)
        for col, cell in zip(COLUMNS[1:], row[1:]):
            assert f"{col.label} {cell}" in block_text.split(" · "), (col.label, block_text)


def test_a_table_that_fits_is_a_table_and_piped_output_is_whole():
    out = _Tty()
    print_table("t", COLUMNS[:4], [r[:4] for r in ROWS], file=out, width=80)
    assert "┃" in out.getvalue() and "…" not in out.getvalue()
    piped = io.StringIO()  # not a terminal: as wide as it needs, borders and headers intact
    print_table("kvbench sweep -> runs/x", COLUMNS, ROWS, file=piped)
    lines = piped.getvalue().splitlines()
    header = next(line for line in lines if "run" in line and "status" in line)
    assert all(c.label in header for c in COLUMNS)
    for row in ROWS:
        line = next(line for line in lines if line.split() and line.split()[0] == row[0])
        assert all(cell in line for cell in row)
    assert not any(line != line.rstrip() for line in lines)


def _records(text: str) -> list[tuple[str, list[str]]]:
    """A table printed as a table (its rows' cells) or one record per block (each record's name and
    its 'label value' pairs), in the order printed."""
    out: list[tuple[str, list[str]]] = []
    for line in _plain(text).splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            out.append((cells[0], cells[1:]))
        elif line.startswith("  ") and out:
            out[-1][1].extend(pair.strip() for pair in line.split(" · "))
        elif line.strip():
            out.append((line.strip(), []))
    return out


def test_bold_cells_are_bold_on_a_terminal_and_cells_are_never_markup():
    for width in (80, 12):  # a table, then one block per record
        out = _Tty()
        print_table("t [x]", [Column("name", right=False), Column("v")], [["[bold]a[/bold]", "1"], ["b", "2"]],
                    file=out, width=width, bold={(1, 1)})
        text = out.getvalue()
        assert "[bold]a[/bold]" in _plain(text) and "t [x]" in _plain(text)  # written as given, not read as markup
        assert "\x1b[1m2\x1b[0m" in text and "\x1b[1m1" not in text, (width, text)
    piped = io.StringIO()
    print_table("t", [Column("name", right=False), Column("v")], [["a", "1"], ["b", "2"]], file=piped, bold={(1, 1)})
    assert "\x1b" not in piped.getvalue()


# the what-if's tables go through print_table too: whole at 80 columns on a terminal and when piped
WHATIF = ["trace", "whatif", REPO / "traces" / "rag.jsonl", "--budgets", "256MiB,1GiB,64GiB", "--no-cache"]
TIERS = ["trace", "whatif", REPO / "traces" / "chat.jsonl", "--tiers", "gpu=256MiB,1GiB,cpu=1GiB,disk=0",
         "--policies", "lru,belady", "--no-cache"]


def _whatif_cells(capsys, argv) -> dict[str, list[tuple[str, dict[str, str]]]]:
    """What the what-if's tables must show, from its --json: each table's title -> its records, each
    a name (the first cell) and the other cells by column label."""
    from kvbench.whatif.output import column_names, versus_lru

    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    w = json.loads(out)
    ceiling = f"{w['ceiling']:.4f}"
    if "tier_policy" in w:
        return {"prefix hit rate by tier": [
            (r["gpu"], {"cpu": r["cpu"], "policy": r["policy"], "hit gpu": f"{r['hit_rate_gpu']:.4f}",
                        "hit cpu": f"{r['hit_rate_cpu']:.4f}", "total": f"{r['hit_rate']:.4f}", "ceiling": ceiling})
            for r in w["rows"]]}
    names = column_names(list(dict.fromkeys(r["policy"] for r in w["rows"])))
    rate = {(r["budget"], r["policy"]): r["hit_rate"] for r in w["rows"]}
    budgets = list(dict.fromkeys(r["budget"] for r in w["rows"]))
    hits, gaps = [], []
    for b in budgets:
        lru, opt = rate[(b, "lru")], rate[(b, "belady")]
        hits.append((b, {names[p]: f"{v:.4f}" for (bb, p), v in rate.items() if bb == b} | {"ceiling": ceiling}))
        gaps.append((b, {"gap": f"{100 * (opt - lru):.2f}" if opt > lru else "none"}
                     | {names[p]: versus_lru(v, lru, opt) for (bb, p), v in rate.items()
                        if bb == b and p not in ("lru", "belady")}))
    return {"prefix hit rate": hits, "each policy against lru": gaps}


def _tables(text: str, titles) -> dict[str, list[tuple[str, list[str]]]]:
    """The printed records of each table, by the title each follows."""
    out: dict[str, list] = {}
    for name, cells in _records(text):
        title = next((t for t in titles if name.startswith(t)), None)
        if title is not None:
            current = out[title] = []
        elif name and not name.startswith(("┏", "┡", "└", "block ", "points:", "rate - lru", "belady's")):
            current.append((name, cells))
    return out


@pytest.mark.parametrize("argv", [WHATIF, TIERS], ids=["curve", "tiers"])
def test_the_whatif_tables_at_80_columns_keep_every_cell_in_its_record(capsys, monkeypatch, argv):
    """Every cell of every what-if table whole and in its own record at 80 columns (mutation: the
    tables printed with rich at the terminal's width again -> cells cut to '0.8…')."""
    want = _whatif_cells(capsys, argv)
    tty = _Tty()
    monkeypatch.setattr(sys, "stdout", tty)
    monkeypatch.setenv("COLUMNS", "80")
    code, _, err = run(capsys, *argv)
    monkeypatch.undo()
    assert code == 0, err
    text = tty.getvalue()
    assert "…" not in text and all(len(line) <= 80 for line in _plain(text).splitlines())
    got = _tables(text, want)
    assert list(got) == list(want)
    for title, records in want.items():
        for name, cells in records:
            # a block holds "label cell" pairs; a table's row holds the cells in its columns' order
            assert any(n == name and (all(f"{label} {cell}" in printed for label, cell in cells.items())
                                      or list(cells.values()) == printed[-len(cells):])
                       for n, printed in got[title]), (title, name, cells, got[title])


@pytest.mark.parametrize("argv", [WHATIF, TIERS], ids=["curve", "tiers"])
def test_the_whatif_tables_piped_are_whole(capsys, argv):
    want = _whatif_cells(capsys, argv)
    code, out, err = run(capsys, *argv)  # capsys: stdout is no terminal
    assert code == 0, err
    assert "…" not in out and not any(line != line.rstrip() for line in out.splitlines())
    for title, records in want.items():
        table = out.split(title, 1)[1].split("\n", 1)[1]  # the lines under the title
        header = next(line for line in table.splitlines() if line.strip())
        for name, cells in records:
            assert all(label in header for label in cells), (header, cells)
            assert any(line.split()[:1] == [name] and all(c in line for c in cells.values())
                       for line in table.splitlines()), (title, name, cells)


def _plain(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_the_sweep_table_piped_keeps_every_run_and_header(tmp_path, capsys):
    code, out, _ = run(capsys, "sweep", CHAT, "--block-size", "16,32", "--layout", "paged,slab", "--limit", "10",
                       "--kv-mem", "4GiB", "--out", tmp_path / "sw")
    assert code == 0 and "…" not in out
    for name in ("paged-bs16-pc_on", "paged-bs16-pc_off", "paged-bs32-pc_on", "paged-bs32-pc_off", "slab"):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    assert "layout + prefix cache" in out and "int. frag" in out and "preempt" in out


def test_a_bare_replay_runs_the_sim_and_says_so(tmp_path, capsys):
    code, out, err = run(capsys, "replay", CHAT, "--limit", "5", "--out", tmp_path / "r")
    assert code == 0
    assert ("kvbench: sim executor: llama-3-8b on the H200 cost model (preset costs; API server front end "
            "22.3 + 11.4 ms a request, --no-front-end: none); --executor model runs a real forward") in err.splitlines()
    settings = json.loads((tmp_path / "r" / "config.json").read_text())["settings"]
    assert (settings["executor"], settings["model"], settings["gpu"]) == ("sim", "llama-3-8b", "h200")
    # the model executor keeps the tiny model as its default on a CPU
    from kvbench.engine.config import ReplayConfig

    assert ReplayConfig(executor="model", device="cpu").validate().model == "tiny"


@pytest.mark.parametrize("name, fmt, what", [
    ("mooncake_conversation.jsonl", "mooncake", "a Mooncake trace"),
    ("azure_conv_2023.csv", "azure", "an Azure LLM inference CSV"),
])
def test_a_raw_real_trace_names_its_conversion(capsys, name, fmt, what):
    path = REAL / name
    if not path.exists():
        pytest.skip("the shared real traces are not here")
    for command in (["replay", path], ["trace", "inspect", path], ["trace", "whatif", path]):
        code, out, err = run(capsys, *command)
        assert code == 2 and out == ""
        assert err.strip().splitlines()[-1] == (
            f"kvbench: error: {path}:1: this is {what}, not a kvbench trace: convert it first with "
            f"kvbench trace convert --from {fmt} {path} -o out.jsonl")


def test_a_sharegpt_file_names_its_conversion(tmp_path, capsys):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}], indent=1))
    code, _, err = run(capsys, "replay", path)
    assert code == 2 and err.strip() == (
        f"kvbench: error: {path}:1: this is a ShareGPT JSON file, not a kvbench trace: convert it first with "
        f"kvbench trace convert --from sharegpt {path} -o out.jsonl")


def test_more_samples_than_the_sequence_cap_is_refused_up_front(tmp_path, capsys):
    trace = REPO / "traces" / "best_of_n.jsonl"
    code, out, err = run(capsys, "replay", trace, "--max-num-seqs", "4", "--out", tmp_path / "r")
    assert code == 2 and out == ""
    assert err.strip() == (
        f"kvbench: error: {trace}:1: field 'n': request 'b0' has n=8 samples but --max-num-seqs is 4: kvbench "
        "runs a request's samples together, so raise --max-num-seqs to 8 (vLLM would fan it out into 8 child "
        "requests instead)")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flag", ["--budgets", "--policies", "--budget-blocks"])
def test_an_empty_list_is_not_the_default(capsys, flag):
    code, out, err = run(capsys, "trace", "whatif", CHAT, flag, "")
    assert code == 2 and out == ""
    assert err.strip() == (f"kvbench: error: {flag}: is empty: give a comma-separated list, or leave the "
                           "option out for its default")
    code, _, err = run(capsys, "trace", "whatif", CHAT, flag, "lru,,fifo" if flag == "--policies" else "1GiB,,2GiB")
    assert code == 2 and "empty value in the list" in err


def test_the_first_run_on_an_install_says_it_compiles(tmp_path):
    """An empty numba cache: the line is said (no compiling here: the check only looks at the cache)."""
    code = ("from kvbench.jit import compile_notice, REPLAY_MODULES, WHATIF_MODULES\n"
            "print(compile_notice(REPLAY_MODULES)); print(compile_notice(('kvbench.whatif.compiled',)))")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    first, second = out.splitlines()
    assert first == ("compiling trace/compiled, trace/compiled_ideal, memory/compiled, scheduler/compiled with numba, "
                     f"once per install (about half a minute on two cores; cached {tmp_path / 'numba'})")
    assert second.startswith("compiling whatif/compiled with numba, once per install")


def test_a_read_only_install_caches_compiled_code_in_the_users_cache(tmp_path, monkeypatch):
    from kvbench import jit

    monkeypatch.setenv("NUMBA_CACHE_DIR", "")  # recorded, so that the value configure_cache sets is undone
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(jit, "writable", lambda path: False)
    assert jit.configure_cache("/usr/lib/python3/site-packages/kvbench") == str(tmp_path / "cache" / "kvbench" / "numba")
    assert os.environ["NUMBA_CACHE_DIR"] == str(tmp_path / "cache" / "kvbench" / "numba")
    assert (tmp_path / "cache" / "kvbench" / "numba").is_dir()
    monkeypatch.setattr(jit, "writable", lambda path: True)
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    assert jit.configure_cache("/x") is None and "NUMBA_CACHE_DIR" not in os.environ


def test_a_replay_in_a_terminal_shows_its_progress_against_the_requests_the_limits_allow(tmp_path):
    """On a terminal (stderr a pty) the replay draws its progress bar: done of the requests
    --max-requests lets go, and exits 0 (it once asked the streamed replay for a list it no longer holds)."""
    import pty
    import threading

    master, slave = pty.openpty()
    seen = bytearray()

    def drain():
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    p = subprocess.run([sys.executable, "-m", "kvbench", "replay", str(CHAT), "--max-requests", "12",
                        "--out", str(tmp_path / "run")], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=slave, cwd=tmp_path, env={**os.environ, "COLUMNS": "160"}, timeout=300)
    os.close(slave)
    reader.join(timeout=10)
    os.close(master)
    text = seen.decode(errors="replace")
    assert p.returncode == 0, text[-2000:]
    assert "/12" in text and "Traceback" not in text
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["requests"] == 12
