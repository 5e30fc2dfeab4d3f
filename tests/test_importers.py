"""Importers on the real shipped traces (Mooncake, Azure) and on small files in every format,
including the wrong format given to an importer."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.errors import InputError
from kvbench.trace.format import load_trace
from kvbench.trace.ideal import ideal_hits
from kvbench.trace.importers import ImportReport, convert, read_mooncake

REAL = Path(__file__).resolve().parents[2] / "shared" / "traces" / "real"
MOONCAKE = REAL / "mooncake_conversation.jsonl"
AZURE = REAL / "azure_conv_2023.csv"
needs_real = pytest.mark.skipif(not MOONCAKE.exists() or not AZURE.exists(),
                                reason=f"real traces not found at {REAL} (a sibling 'shared' checkout)")


@needs_real
def test_mooncake_full_trace_ideal_hit_rate():
    report = ImportReport()
    reqs = list(read_mooncake(str(MOONCAKE), report))
    assert len(reqs) == 12_031 and not report.skipped
    assert sum(r.prompt_len for r in reqs) == 144_793_823  # input_length summed over the rows
    assert ideal_hits(reqs, 16).hit_rate == pytest.approx(0.374, abs=0.005)


@needs_real
def test_azure_full_trace_converts(tmp_path):
    out = tmp_path / "azure.jsonl"
    report = convert("azure", AZURE, out)
    assert report.written == 19_366 and not report.skipped
    reqs = load_trace(out)
    assert len(reqs) == 19_366 and reqs[0].t == 0.0
    assert reqs[0].prompt[0].to_json() == {"unique": 374} and reqs[0].output_len == 44
    assert 3500 < reqs[-1].t < 3600  # one hour of traffic


def test_mooncake_rows_map_to_512_token_shared_blocks(tmp_path):
    src = tmp_path / "m.jsonl"
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
            {"timestamp": 1500, "input_length": 600, "output_length": 0, "hash_ids": [0, 3]},
            {"timestamp": 2250, "input_length": 512, "output_length": 3, "hash_ids": [0]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o.jsonl"
    report = convert("mooncake", src, out)
    assert report.written == 2 and report.skipped == {"with 0 output tokens": 1}
    a, b = load_trace(out)
    assert [s.to_json() for s in a.prompt] == [{"shared": "mooncake/0", "len": 512},
                                              {"shared": "mooncake/1", "len": 512},
                                              {"shared": "mooncake/2", "len": 76}]
    assert (a.id, a.t, a.output_len, b.id, b.t) == ("1", 0.0, 7, "3", 2.25)
    assert ideal_hits([a, b], 16).hit_tokens == 496  # b's one block, less the last token's block


def test_mooncake_hash_ids_must_cover_input_length(tmp_path):
    src = tmp_path / "m.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1]}\n')
    with pytest.raises(InputError, match=r"m.jsonl:1: field 'hash_ids'"):
        convert("mooncake", src, tmp_path / "o.jsonl")
    assert not (tmp_path / "o.jsonl").exists()


def test_azure_times_are_relative_to_the_first_row(tmp_path):
    src = tmp_path / "a.csv"
    src.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.6805900,374,44\n"
                   "2023-11-16 18:15:50.9951690,396,0\n"
                   "2023-11-16 18:16:46.6805900,10,5\n")
    out = tmp_path / "o.jsonl"
    report = convert("azure", src, out)
    assert report.written == 2 and sum(report.skipped.values()) == 1
    a, b = load_trace(out)
    assert (a.t, b.t, b.prompt_len, b.output_len, b.id) == (0.0, 60.0, 10, 5, "4")


BURST6 = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
          "5.0,ChatGPT,472,18,490,Conversation log\n"
          "7.5,GPT-4,1020,0,1020,Conversation log\n"
          "9.0,ChatGPT,30,12,42,API log\n")
# The 8-column release (columns by header name, so order does not matter).
BURST8 = ("Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
          "19440110.0,1722ac82,43,GPT-4,906,446,1352,Conversation log\n"
          "19440161.0,d5983bf9,2,ChatGPT,36,0,36,Conversation log\n")


@pytest.mark.parametrize("text,written,first", [
    (BURST6, 2, {"id": "2", "t": 0.0, "output_len": 18, "prompt": [{"unique": 472}],
                 "meta": {"model": "ChatGPT", "log_type": "Conversation log"}}),
    (BURST8, 1, {"id": "2", "t": 0.0, "session": "1722ac82", "output_len": 446,
                 "prompt": [{"unique": 906}], "meta": {"model": "GPT-4", "log_type": "Conversation log"}}),
])
def test_burstgpt_layouts_and_failures(tmp_path, text, written, first):
    src = tmp_path / "b.csv"
    src.write_text(text)
    out = tmp_path / "o.jsonl"
    report = convert("burstgpt", src, out)
    assert report.written == written and report.skipped == {"with 0 output tokens (failed)": 1}
    assert load_trace(out)[0].to_json() == first


SHAREGPT = [
    {"id": "conv1", "conversations": [
        {"from": "human", "value": "x" * 400}, {"from": "gpt", "value": "y" * 803},
        {"from": "human", "value": "z" * 40}, {"from": "gpt", "value": "w" * 80},
        {"from": "human", "value": "unanswered"}]},
    {"id": "conv2", "conversations": [{"from": "human", "value": "hello"}]},
]


def test_sharegpt_turns_resend_history_and_name_answers(tmp_path):
    src = tmp_path / "sg.json"
    src.write_text(json.dumps(SHAREGPT))
    out = tmp_path / "o.jsonl"
    report = convert("sharegpt", src, out, rate=2.0, seed=3)
    assert report.written == 2 and report.skipped == {"conversations with no answered turn": 1}
    assert any("4 characters" in n or "characters / 4" in n for n in report.notes)
    t1, t2 = load_trace(out)
    assert t1.session == t2.session == "conv1" and t1.t <= t2.t
    assert [s.to_json() for s in t1.prompt] == [{"shared": "sharegpt/conv1/0", "len": 100}]
    assert (t1.output, t1.output_len) == ("sharegpt/conv1/1", 201)  # ceil(803 / 4)
    assert [s.to_json() for s in t2.prompt] == [{"shared": "sharegpt/conv1/0", "len": 100},
                                               {"shared": "sharegpt/conv1/1", "len": 201},
                                               {"shared": "sharegpt/conv1/2", "len": 10}]
    # Turn 2 hits its history, the answer included (cached while turn 1 decoded it).
    assert ideal_hits([t1, t2], 16).hit_tokens == 288  # 300 tokens of history, in whole blocks


def test_sharegpt_with_a_local_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    src = tmp_path / "sg.json"
    src.write_text(json.dumps([{"id": "c", "conversations": [
        {"from": "human", "value": "hello world hello"}, {"from": "gpt", "value": "world"}]}]))
    report = convert("sharegpt", src, tmp_path / "o.jsonl", tokenizer=str(tmp_path / "tok"))
    (r,) = load_trace(tmp_path / "o.jsonl")
    assert (r.prompt_len, r.output_len, report.notes) == (3, 1, [])


def _convert_cli(fmt, src, tmp_path):
    return subprocess.run([sys.executable, "-m", "kvbench", "trace", "convert", "--from", fmt, str(src),
                           "-o", str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("fmt,content,words", [
    ("mooncake", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n",
     "expected a Mooncake JSONL trace"),
    ("mooncake", '{"t": 0, "output_len": 3, "prompt": [{"unique": 5}]}\n', "is this a Mooncake"),
    ("azure", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n',
     "not an Azure"),
    ("burstgpt", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n", "not a BurstGPT"),
    ("sharegpt", '{"timestamp": 0}\n{"timestamp": 1}\n', "ShareGPT"),
    ("sharegpt", '{"conversations": []}', "list of conversations"),
])
def test_wrong_format_says_so(tmp_path, fmt, content, words):
    src = tmp_path / "input.txt"
    src.write_text(content)
    r = _convert_cli(fmt, src, tmp_path)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert str(src) in r.stderr and words in r.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_convert_prints_a_one_line_summary(tmp_path):
    src = tmp_path / "b.csv"
    src.write_text(BURST6)
    r = _convert_cli("burstgpt", src, tmp_path)
    assert r.returncode == 0 and r.stdout == ""
    assert r.stderr.strip() == (f"kvbench: converted burstgpt: wrote 2 requests to {tmp_path / 'out.jsonl'}"
                                "; skipped 1 (1 with 0 output tokens (failed))")
