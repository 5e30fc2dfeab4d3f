"""The incremental parquet writer under Ctrl-C: a row group is in the file once whenever the interrupt
comes (during the write, or while a row is half appended), and the interrupt still stops the run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbench.engine.records import Table, _column, column_numpy, interrupt_held

TRACES = Path(__file__).resolve().parents[1] / "traces"

SCHEMA = pa.schema([("i", pa.int64()), ("x", pa.float64())])


def test_ctrl_c_during_a_row_groups_write_leaves_it_in_the_file_once(tmp_path, monkeypatch):
    path = tmp_path / "t.parquet"
    t = Table(str(path), SCHEMA, flush_rows=4)
    write = t.writer.write_table

    def write_then_ctrl_c(table):  # the signal arrives while the row group is being written
        write(table)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(t.writer, "write_table", write_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        for i in range(6):
            t.add((i, i / 2))
    monkeypatch.setattr(t.writer, "write_table", write)
    t.close()  # what the replay's finally does: the buffer is flushed, nothing twice
    assert pq.read_table(path).column("i").to_pylist() == [0, 1, 2, 3]


def test_a_row_of_the_wrong_width_is_refused_not_cut(tmp_path):
    """Rows are buffered as tuples and transposed at the flush, which would cut a long row or pad
    nothing for a short one silently: a row of another width is an error naming the file."""
    path = tmp_path / "t.parquet"
    t = Table(str(path), SCHEMA, flush_rows=100)
    t.add((0, 0.0))
    t.add((1, 0.5, 7))
    with pytest.raises(ValueError, match="rows of \\[2, 3\\] values for the 2 columns of .*t.parquet"):
        t.flush()


def test_interrupt_held_restores_the_handler_and_raises_after_the_block():
    before = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupt_held():
            os.kill(os.getpid(), signal.SIGINT)
            done.append(1)  # the block runs to its end
    assert done == [1] and signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("table", ["steps", "requests"])
def test_an_interrupted_runs_summary_counts_the_rows_it_wrote(tmp_path, monkeypatch, table):
    """Ctrl-C just after a row group of ``table`` is written (two replicas, small row groups): every
    count in summary.json, the replicas' too, is that of the rows in the files."""
    import json

    import pandas as pd

    from kvbench.engine import records
    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.replay import replay

    init = records.Table.__init__

    def small_groups(self, path, schema, flush_rows):
        init(self, path, schema, 16)
        if os.path.basename(path) == f"{table}.parquet":
            write, n = self.writer.write_table, [0]

            def write_then_ctrl_c(t):
                write(t)
                n[0] += 1
                if n[0] == 3:
                    os.kill(os.getpid(), signal.SIGINT)
            self.writer.write_table = write_then_ctrl_c

    monkeypatch.setattr(records.Table, "__init__", small_groups)
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        replay(str(Path(__file__).resolve().parents[1] / "traces" / "chat.jsonl"), ReplayConfig(model="tiny", limit=120, time_scale=0.05, replicas=2), str(out))
    s = json.loads((out / "summary.json").read_text())
    req, steps = pd.read_parquet(out / "requests.parquet"), pd.read_parquet(out / "steps.parquet")
    done = req[req["rejected"].isna()]
    assert s["complete"] is False and s["steps"] == len(steps) > 0
    assert s["completed"] == len(done) and s["output_tokens"] == int(done["output_tokens"].sum())
    assert s["rejected"] == int(req["rejected"].notna().sum())
    for r in s["per_replica"]:
        assert r["steps"] == int((steps["replica"] == r["replica"]).sum())
        assert r["completed"] == int((done["replica"] == r["replica"]).sum())


def test_a_second_ctrl_c_while_the_summary_is_written_still_leaves_the_summary(tmp_path, monkeypatch):
    """The first Ctrl-C stops the replay; a second one, while the run closes, waits until summary.json
    is written (a sweep's worker may get two: the terminal's and the parent's)."""
    import json

    from kvbench.engine import accounting
    from kvbench.engine.config import ReplayConfig
    from kvbench.engine.replay import Replay

    summary = accounting.Accounts.summary

    def ctrl_c_twice(self, *a, **kw):
        os.kill(os.getpid(), signal.SIGINT)  # the second, while the summary is being made
        return summary(self, *a, **kw)

    monkeypatch.setattr(accounting.Accounts, "summary", ctrl_c_twice)
    out = tmp_path / "cut"
    rp = Replay(str(Path(__file__).resolve().parents[1] / "traces" / "chat.jsonl"),
                ReplayConfig(model="tiny", limit=40), str(out))

    def first_ctrl_c(p):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rp.run(on_progress=first_ctrl_c)
    s = json.loads((out / "summary.json").read_text())
    assert s["complete"] is False and "steps" in s


COLUMNS = [  # (values, type): nulls, NaN, extremes, unicode and empty strings, numpy scalars
    ([1, None, -(2**63), 2**63 - 1, 0], pa.int64()),
    ([np.int64(3), 4, True], pa.int64()),
    ([1.5, None, float("nan"), float("inf"), 3, -0.0], pa.float64()),
    ([None, None], pa.float64()),
    (["a", None, "ü€𝄞", "", "x" * 1000], pa.string()),
    ([None], pa.string()),
]


@pytest.mark.parametrize(("values", "type_"), COLUMNS)
def test_columns_built_from_buffers_are_what_pa_array_makes(values, type_):
    """Table writes int64, float64 and string columns from numpy buffers (pa.array imports pandas):
    the same values, nulls and NaNs as pa.array's, and back through column_numpy as to_numpy's."""
    got, want = _column(list(values), type_), pa.array([int(v) if isinstance(v, bool) else v for v in values], type=type_)
    assert got.type == want.type and got.null_count == want.null_count
    assert repr(got.to_pylist()) == repr(want.to_pylist())  # (repr: NaN equal to NaN, -0.0 apart from 0.0)
    if type_ != pa.string():
        chunked = pa.chunked_array([got.slice(0, 1), got.slice(1)])  # an offset and two chunks
        assert np.array_equal(column_numpy(chunked), want.to_numpy(zero_copy_only=False), equal_nan=True)
    assert np.array_equal(column_numpy(got.is_null()), want.is_null().to_numpy(zero_copy_only=False))


def test_odd_values_go_through_pa_array_and_its_errors():
    assert _column([1.5, 2.0], pa.float64()).to_pylist() == [1.5, 2.0]
    with pytest.raises(pa.ArrowInvalid):
        _column(["x"], pa.int64())
    with pytest.raises((pa.ArrowTypeError, pa.ArrowInvalid)):
        _column([1], pa.string())


def test_a_sim_replay_does_not_import_pandas(tmp_path):
    """Writing and summarising a run asks nothing of pandas, whose import costs a run ~0.2 s."""
    code = ("import sys; from kvbench.engine.config import ReplayConfig; from kvbench.engine.replay import Replay; "
            f"Replay({str(TRACES / 'chat.jsonl')!r}, ReplayConfig(executor='sim', num_blocks=4000, limit=200), "
            f"{str(tmp_path / 'run')!r}).run(); print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert pq.read_table(tmp_path / "run" / "requests.parquet").num_rows == 200


def test_rows_read_back_as_written_dictionary_pages_for_strings_only(tmp_path):
    """A table's rows come back as they were added (nulls, NaN, strings); only its string columns are
    dictionary-encoded (a numeric column's values rarely repeat: encoding them cost most of a row
    group's write)."""
    schema = pa.schema([("id", pa.string()), ("n", pa.int64()), ("x", pa.float64()), ("s", pa.string())])
    rows = [(f"r{i}", i if i % 7 else None, i / 3 if i % 5 else float("nan"), None if i % 3 else "sess") for i in range(50)]
    t = Table(str(tmp_path / "t.parquet"), schema, flush_rows=16)
    for row in rows:
        t.add(row)
    t.close()
    f = pq.ParquetFile(tmp_path / "t.parquet")
    back = list(zip(*(f.read().column(c).to_pylist() for c in schema.names)))
    assert repr(back) == repr(rows)
    meta = f.metadata
    assert meta.num_row_groups == 4
    dictionary = {schema.names[c]: meta.row_group(0).column(c).has_dictionary_page for c in range(len(schema))}
    assert dictionary == {"id": True, "n": False, "x": False, "s": True}
