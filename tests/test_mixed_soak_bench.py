"""bench/mixed_soak.py's pure parts: its requests, the text a streamed line carries, the
gap statistics, what ran across a gap, the report and the command line."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import mixed_soak
from bench.mixed_soak import Record


def test_each_kind_is_a_request_of_its_own():
    paths = {k: mixed_soak.stream_request(k, "m", 3)[0] for k in mixed_soak.STREAM_KINDS}
    assert paths == {
        "OpenAI chat": "/v1/chat/completions",
        "Ollama chat": "/api/chat",
        "span query": "/v1/query/execute?stream=true",
    }
    sizes = [len(mixed_soak.other_request("embeddings", "m", i)[1]["input"]) for i in range(4)]
    assert sizes == [64, 128, 256, 512]
    generate = mixed_soak.other_request("Ollama generate", "m", 1)[1]
    assert generate["stream"] is False
    assert mixed_soak.other_request("Ollama embed", "m", 1)[0] == "/api/embed"


def test_a_piece_is_the_text_a_line_carries():
    chat = {"choices": [{"delta": {"content": "Hi"}}]}
    assert mixed_soak.piece("OpenAI chat", "data: " + json.dumps(chat)) == "Hi"
    role = {"choices": [{"delta": {"role": "assistant"}}]}
    assert mixed_soak.piece("OpenAI chat", "data: " + json.dumps(role)) == ""
    assert mixed_soak.piece("OpenAI chat", "data: [DONE]") == ""
    assert mixed_soak.piece("span query", 'data: {"choices": [{"text": " a"}]}') == " a"
    assert mixed_soak.piece("Ollama chat", '{"message": {"content": "b"}, "done": false}') == "b"
    assert mixed_soak.piece("Ollama chat", '{"message": {"content": ""}, "done": true}') == ""
    assert mixed_soak.piece("Ollama chat", "") == ""


def test_gap_statistics():
    gaps = mixed_soak.gaps([0.0, 0.1, 0.3, 1.5, 1.6])
    assert gaps == pytest.approx([0.1, 0.2, 1.2, 0.1])
    stats = mixed_soak.gap_stats(gaps)
    assert stats["gaps"] == 4
    assert stats["max_s"] == pytest.approx(1.2)
    assert stats["slow_share"] == 0.25
    assert stats["p99_s"] == pytest.approx(1.2 - 0.03 * 1.0)  # between 0.2 and 1.2
    assert mixed_soak.gap_stats([]) == {"gaps": 0, "max_s": None, "p99_s": None, "slow_share": None}


def test_the_worst_gaps_name_what_ran_across_them():
    stream = Record("OpenAI chat", 0.0, 5.0, 200, [1.0, 1.15, 3.0, 3.1])
    prefill = Record("span query", 2.0, 4.0, 200, [2.5, 2.55])  # its prefill: 2.0 to 2.5
    batch = Record("embeddings", 0.5, 2.2, 200)
    later = Record("Ollama embed", 3.5, 4.0, 200)
    worst = mixed_soak.worst_gaps([stream, prefill, batch, later], 2)
    assert [w["kind"] for w in worst] == ["OpenAI chat", "OpenAI chat"]
    assert worst[0]["gap_s"] == pytest.approx(1.85)
    assert worst[0]["at_s"] == pytest.approx(1.15)
    assert worst[0]["with"] == ["embeddings", "span query start"]
    assert worst[1]["with"] == ["embeddings"]  # 1.0 to 1.15
    other = Record("Ollama chat", 0.0, 5.0, 200, [1.2, 2.9])  # the same stall, seen again
    assert [w["kind"] for w in mixed_soak.worst_gaps([stream, other], 2)] == ["OpenAI chat"] * 2


def test_the_report_says_whether_every_gap_stayed_under_a_second():
    records = [
        Record("OpenAI chat", 0.0, 2.0, 200, [0.5, 0.6, 1.9]),
        Record("Ollama chat", 0.0, 1.0, 200, [0.2, 0.3]),
        Record("embeddings", 0.1, 1.8, 200),
        Record("Ollama generate", 0.1, 0.2, 0),
    ]
    result = mixed_soak.summary(records, [0.01, 0.08], (0.42, 1.5))
    args = mixed_soak.parse_args(["--minutes", "0.5"])
    text = mixed_soak.report(result, args)
    assert "0.5 minutes, 2 threads, 2 streams of each kind; load average 0.42" in text
    assert "| OpenAI chat | 1 | 3 | 1,300 ms |" in text
    assert "| 50.00% |" in text
    assert "| Ollama generate | 1 | 1 | | |" in text
    assert "largest latency 80 ms" in text
    assert "Not every gap stayed under 1 s: the largest was 1,300 ms." in text
    assert "| OpenAI chat | 1,300 ms | 1 s | embeddings |" in text


def test_the_command_line():
    args = mixed_soak.parse_args([])
    assert (args.minutes, args.streams, args.threads, args.markdown) == (5.0, 2, 2, None)
    assert mixed_soak.parse_args(["--streams", "1", "--markdown", "t.md"]).markdown == Path("t.md")
    with pytest.raises(SystemExit):
        mixed_soak.parse_args(["--minutes", "0"])
