"""The trace reader through the CLI and the library: every kind of bad input is one line naming
file, line and field, exit 2; and the rule for a shared name used at different lengths."""
import json
import subprocess
import sys

import numpy as np
import pytest

from kvbench.errors import InputError
from kvbench.trace.format import Request, Segment, load_trace, write_trace
from kvbench.trace.ideal import ideal_hits
from kvbench.trace.tokens import TokenStreams

GOOD = '{"id": "a", "t": 0, "output_len": 4, "prompt": [{"shared": "sys", "len": 40}]}'


def _inspect(path):
    return subprocess.run([sys.executable, "-m", "kvbench", "trace", "inspect", str(path)],
                          capture_output=True, text=True, timeout=60)


BAD_LINES = [
    # (second line of the trace, field the message must name or None, words it must contain)
    ('{"id": "b", "t": 1, "output_len": 4, "prompt": [{"unique": 8}]', None, "malformed JSON"),
    ('{"id": "b", "t": 1, "prompt": [{"unique": 8}]}', "output_len", "missing"),
    ('{"id": "b", "t": 1, "output_len": 4, "prompt": [{"unique": -3}]}', "prompt[0].unique", "at least 1"),
    ('{"id": "b", "t": 1, "output_len": 4, "prompt": [{"shared": "s", "len": -1}]}', "prompt[0].len",
     "at least 1"),
    ('{"id": "b", "t": 1, "output_len": 4, "prompt": [{"image": 8}]}', "prompt[0]", "exactly one of"),
    ('{"id": "a", "t": 1, "output_len": 4, "prompt": [{"unique": 8}]}', "id", "duplicate"),
    ('{"id": "b", "t": -1, "output_len": 4, "prompt": [{"unique": 8}]}', "t", ">= 0"),
]


@pytest.mark.parametrize("line,field,words", BAD_LINES)
def test_bad_trace_is_one_line_exit_2(tmp_path, line, field, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + "\n" + line + "\n")
    r = _inspect(path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{path}:2:" in lines[0] and words in lines[0]
    if field is not None:
        assert f"field '{field}'" in lines[0]
    assert r.stdout == ""


def test_non_utf8_names_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = b'{"t": 0, "output_len": 4, "prompt": [{"unique": 8}]}\n'  # ids default to line numbers
    path.write_bytes(good * 300 + b'{"id": "caf\xe9", "t": 0}\n')
    r = _inspect(path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert f"{path}:301:" in r.stderr and "UTF-8" in r.stderr


def test_missing_file_and_empty_trace(tmp_path):
    r = _inspect(tmp_path / "nope.jsonl")
    assert r.returncode == 2 and "cannot open" in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(InputError, match="no requests"):
        load_trace(empty)


def test_shared_stream_is_unbounded_longer_use_extends_shorter():
    streams = TokenStreams()
    short = Request("1", 0.0, (Segment("shared", 100, name="doc"),), 1)
    long = Request("2", 1.0, (Segment("shared", 300, name="doc"),), 1)
    a, b = streams.expand(short), streams.expand(long)
    assert np.array_equal(a, b[:100])  # they agree on the common prefix
    assert len(b) == 300
    # In the ideal count the longer request hits the shorter one's whole blocks (96 of 100 tokens).
    assert ideal_hits([short, long], 16).hit_tokens == 96


def test_round_trip_and_no_partial_file_on_failure(tmp_path):
    reqs = [Request("x", 0.5, (Segment("shared", 10, name="s"), Segment("unique", 3),
                               Segment("tokens", 2, tokens=(5, 6))), 7, session="s1", n=2,
                    output="ans", meta={"workload": "t"})]
    path = tmp_path / "t.jsonl"
    assert write_trace(reqs, path) == 1
    back = load_trace(path)[0]
    assert back.to_json() == reqs[0].to_json() and back.prompt_len == 15

    def failing():
        yield reqs[0]
        raise InputError("bad row")

    with pytest.raises(InputError):
        write_trace(failing(), tmp_path / "u.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def test_integer_ids_and_default_id_is_line_number(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text('{"t": 0, "output_len": 1, "prompt": [{"unique": 2}]}\n\n'
                    '{"id": 7, "t": 0, "output_len": 1, "prompt": [{"text": "hi"}]}\n')
    reqs = load_trace(path)
    assert [r.id for r in reqs] == ["1", "7"] and reqs[1].line == 3
    assert json.loads(json.dumps(reqs[1].to_json()))["prompt"] == [{"text": "hi"}]


@pytest.mark.parametrize("seg,field,words", [
    ({"shared": "s", "len": 0}, "prompt[0].len", "at least 1"),
    ({"shared": "s", "len": True}, "prompt[0].len", "integer"),
    ({"shared": "s", "len": 2**24 + 1}, "prompt[0].len", "at most"),
    ({"shared": "", "len": 4}, "prompt[0].shared", "non-empty"),
    ({"shared": "s" * 4097, "len": 4}, "prompt[0].shared", "longer than"),
    ({"shared": "s", "size": 4}, "prompt[0]", "unknown key"),
    ({"unique": 0}, "prompt[0].unique", "at least 1"),
    ({"unique": False}, "prompt[0].unique", "integer"),
    ({"unique": 8.0}, "prompt[0].unique", "integer"),
])
def test_the_common_segment_shapes_are_checked_as_any_other(seg, field, words):
    """parse_request takes {"shared", "len"} and {"unique"} without a call per segment
    (format._common_segment): a value the full checks refuse is refused, by the same error."""
    from kvbench.trace.format import parse_request

    where = {"file": "t.jsonl", "line": 3}
    with pytest.raises(InputError) as e:
        parse_request({"id": "a", "t": 0, "output_len": 2, "prompt": [seg]}, where, 0)
    assert e.value.field == field and words in str(e.value)
    ok = parse_request({"id": "a", "t": 0, "output_len": 2,
                        "prompt": [{"shared": "sÿs", "len": 4}, {"unique": 2**24 - 8}]}, where, 0)
    assert ok.prompt == (Segment("shared", 4, name="sÿs"), Segment("unique", 2**24 - 8)) and ok.prompt_len == 2**24 - 4
