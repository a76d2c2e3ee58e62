"""bench/serve.py's pure parts: prompts, SSE parsing, verdicts, statistics, tables; no server
runs."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import serve

MAX = 128


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def streamed(lines: list[str], times: list[float] | None = None) -> serve.Outcome:
    """An outcome fed ``lines`` (at ``times``, else 1, 2, ...) after a 200."""
    outcome = serve.Outcome("short", 0.0, status=200)
    for line, now in zip(lines, times or range(1, len(lines) + 1), strict=True):
        serve.read_event(outcome, line, float(now))
    return outcome


def chunk(text: str, reason: str = "null") -> str:
    return f'data: {{"choices": [{{"index": 0, "text": "{text}", "finish_reason": {reason}}}]}}'


def test_prompt_mix_is_three_short_to_one_long_and_each_prompt_its_own():
    mix = serve.prompt_mix(4, 8, "LONG")
    assert [p.kind for p in mix] == ["short", "short", "short", "long"] * 2
    assert mix[0].text.startswith("Request 4: ")
    assert mix[3].text == "Request 7: LONG"
    assert len({p.text for p in mix}) == 8
    assert serve.prompt_mix(4, 8, "LONG") == mix  # deterministic


def test_long_text_is_the_shipped_texts_start():
    text = serve.long_text()
    assert len(text.split(" ")) == serve.LONG_WORDS
    assert (serve.harness.DATA / "english.txt").read_text().startswith(text)


def test_request_body_per_endpoint():
    body = serve.request_body("completions", "m", "hi", 128)
    assert body["prompt"] == "hi"
    assert body["stream_options"] == {"include_usage": True}
    assert (body["stream"], body["temperature"], body["max_tokens"]) == (True, 0, 128)
    chat = serve.request_body("chat", "m", "hi", 128)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert "prompt" not in chat
    assert serve.endpoint_url("http://h:1", "chat") == "http://h:1/v1/chat/completions"


@pytest.mark.parametrize("url", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"])
def test_root_url(url):
    assert serve.root_url(url) == "http://h:1"


def test_a_whole_stream_with_usage():
    lines = [chunk("a"), "", ": ping", chunk("b"), chunk("", '"length"')]
    lines += ['data: {"choices": [], "usage": {"completion_tokens": 2}}', "data: [DONE]"]
    outcome = streamed(lines)
    assert outcome.chunk_times == [1.0, 4.0]  # the empty text and the comment do not count
    assert (outcome.finish_reason, outcome.usage_tokens, outcome.done) == ("length", 2, True)
    assert serve.verdict(outcome, 2) == (serve.OK, "")


def test_an_empty_text_before_the_end_is_a_token():
    outcome = streamed([chunk("a"), chunk(""), chunk("", '"length"'), "data: [DONE]"])
    assert outcome.tokens == 2
    assert serve.verdict(outcome, 2) == (serve.OK, "")


def test_chat_deltas_count_and_tokens_fall_back_to_chunks():
    lines = [
        'data: {"choices": [{"delta": {"role": "assistant"}, "finish_reason": null}]}',
        'data: {"choices": [{"delta": {"role": "assistant", "content": "a"}}]}',
        'data: {"choices": [{"delta": {"content": "b"}, "finish_reason": null}]}',
        'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}',
        "data: [DONE]",
    ]
    outcome = streamed(lines)
    assert outcome.chunk_times == [2.0, 3.0]  # the role alone is no token
    assert serve.verdict(outcome, MAX) == (serve.OK, "")  # "stop" early is EOS, not a cut


def test_verdicts():
    lost = serve.Outcome("short", 0.0, transport_error="ConnectError: refused")
    assert serve.verdict(lost, MAX)[0] == serve.LOST
    refused = serve.Outcome("short", 0.0, status=503, server_error="busy")
    assert serve.verdict(refused, MAX) == (serve.FAILED, "HTTP 503: busy")
    assert serve.verdict(streamed(['data: {"error": {"message": "x"}}']), MAX)[0] == serve.FAILED
    assert serve.verdict(streamed(["data: {oops"]), MAX)[0] == serve.FAILED
    no_reason = streamed([chunk("a"), "data: [DONE]"])  # llama.cpp's interrupted stream
    assert serve.verdict(no_reason, MAX) == (
        serve.TRUNCATED,
        "ended without finish_reason after 1 tokens",
    )
    no_done = streamed([chunk("a", '"stop"')])
    assert "[DONE]" in serve.verdict(no_done, MAX)[1]
    cut = streamed([chunk("a")])
    cut.transport_error = "RemoteProtocolError: incomplete"
    assert serve.verdict(cut, MAX)[0] == serve.TRUNCATED
    short = streamed([chunk("a", '"length"'), "data: [DONE]"])
    assert serve.verdict(short, MAX) == (serve.TRUNCATED, '"length" after 1 of 128 tokens')
    more = streamed([chunk("a"), chunk("b", '"stop"'), 'data: {"usage": {"completion_tokens": 1}}'])
    more.done = True
    assert serve.verdict(more, MAX) == (serve.TRUNCATED, "2 text chunks, usage 1")


def test_percentile_interpolates_between_ranks():
    assert serve.percentile([], 50) is None
    assert serve.percentile([3.0], 99) == 3.0
    assert serve.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert serve.percentile([float(v) for v in range(101)], 99) == pytest.approx(99.0)
    assert serve.percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def finished(sent: float, times: list[float], usage: int | None = None) -> serve.Outcome:
    outcome = serve.Outcome("short", sent, list(times), 200, "length", usage, True)
    return outcome


def test_summarize():
    outcomes = [
        finished(0.0, [1.0, 1.5, 2.0], usage=3),  # 3 tokens in 1 s after the first: 2 tok/s
        finished(0.0, [2.0, 2.25, 2.5, 2.75, 3.0]),  # 5 chunks, no usage: 4 tok/s
        serve.Outcome("long", 0.0, transport_error="ConnectError: refused"),
    ]
    s = serve.summarize(outcomes, wall_s=4.0, max_tokens=3)
    assert (s["requests"], s["tokens"], s["tok_s"]) == (3, 8, 2.0)
    assert s["ttft_p50_s"] == 1.5
    assert s["itl_p50_s"] == 0.25
    assert s["itl_p99_s"] == pytest.approx(0.5)
    assert s["stream_tok_s"] == 3.0
    assert (s["failed"], s["lost"], s["truncated"]) == (0, 1, 0)
    assert s["usage_counted"] == 1
    assert s["finish_reasons"] == {"length": 2, "None": 1}
    assert s["problems"] == ["lost: no response: ConnectError: refused"]


def test_levels_default_requests_and_soak():
    args = serve.parse_args([])
    assert args.concurrency == [1, 4, 16, 64]
    assert serve.levels(args) == [(1, 8), (4, 8), (16, 32), (64, 128)]
    assert serve.levels(serve.parse_args(["--concurrency", "2", "--requests", "5"])) == [(2, 5)]
    assert serve.levels(serve.parse_args(["--soak", "1000"])) == [(16, 1000)]


def test_llama_cpp_runs_without_interruption(tmp_path):
    argv, _ = serve.server_command(
        "llama.cpp", tmp_path / "m.gguf", 1234, 2, serve.Peers("py", None)
    )
    assert argv[:3] == ["py", "-m", "llama_cpp.server"]
    assert argv[argv.index("--interrupt_requests") + 1] == "False"
    assert argv[argv.index("--n_threads") + 1] == "2"
    assert argv[argv.index("--port") + 1] == "1234"


def test_llama_server_batches_over_slots_and_says_how_to_build_it(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("")
    argv, _ = serve.server_command(
        "llama-server", tmp_path / "m.gguf", 1, 2, serve.Peers("py", binary)
    )
    assert argv[argv.index("-np") + 1] == str(serve.SLOTS)
    assert argv[argv.index("-c") + 1] == str(serve.SLOTS * serve.LLAMA_N_CTX)
    assert argv[argv.index("-t") + 1] == "2"
    with pytest.raises(serve.ServerError, match="cmake --build build --target llama-server"):
        serve.server_command("llama-server", tmp_path / "m.gguf", 1, 2, serve.Peers("py", None))


def test_ours_gets_llama_servers_kv_room_unless_a_budget_is_set(tmp_path, monkeypatch):
    peers = serve.Peers("py", None)
    monkeypatch.delenv("MISTRALRS_PAGED_ATTN_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("MISTRALRS_PAGED_ATTN_MEMORY_FRACTION", raising=False)
    monkeypatch.delenv("MISTRALRS_PAGED_ATTN_MEMORY_MB", raising=False)
    _, env = serve.server_command("ours", tmp_path / "m.gguf", 1, 2, peers)
    assert env["MISTRALRS_PAGED_ATTN_CONTEXT_LEN"] == str(serve.SLOTS * serve.LLAMA_N_CTX)
    monkeypatch.setenv("MISTRALRS_PAGED_ATTN_MEMORY_MB", "512")
    _, env = serve.server_command("ours", tmp_path / "m.gguf", 1, 2, peers)
    assert "MISTRALRS_PAGED_ATTN_CONTEXT_LEN" not in env


def test_ours_decodes_without_speculation_unless_the_environment_names_a_method(
    tmp_path, monkeypatch
):
    peers = serve.Peers("py", None)
    monkeypatch.delenv("MISTRALRS_SPECULATIVE_METHOD", raising=False)
    _, env = serve.server_command("ours", tmp_path / "m.gguf", 1, 2, peers)
    assert env["MISTRALRS_SPECULATIVE_METHOD"] == "none"  # as the peers decode
    monkeypatch.setenv("MISTRALRS_SPECULATIVE_METHOD", "ngram")
    _, env = serve.server_command("ours", tmp_path / "m.gguf", 1, 2, peers)
    assert env["MISTRALRS_SPECULATIVE_METHOD"] == "ngram"


def test_ratios_against_llama_server():
    ours = {"engine": "spnl-backend", "levels": [summary(16, tok_s=300.0, ttft_p99_s=1.0)]}
    peer = {"engine": "llama-server -np 16", "levels": [summary(16, tok_s=150.0, ttft_p99_s=4.0)]}
    assert serve.ratios([ours, peer]) == [
        "16 clients: 2.00x llama-server's output tok/s; p99 TTFT 0.25x its."
    ]


def summary(clients: int, **overrides) -> dict:
    outcomes = [finished(0.0, [0.5 + 0.01 * i for i in range(MAX)], usage=MAX)] * 4
    return {"clients": clients} | serve.summarize(outcomes, 2.0, MAX) | overrides


def test_table_rows_notes_and_a_not_run_row():
    results = [
        {"engine": "spnl-backend", "levels": [summary(1), summary(4)], "rss": 900.0},
        {"engine": "llama-cpp-python", "error": "not ready after 300 s (a \\| b)"},
    ]
    text = serve.table(results, soak=False, threads=2, max_tokens=MAX, endpoint="completions")
    lines = text.splitlines()
    assert lines[0].count("|") == len(serve.HEADER) + 1
    row = cells(lines[2])
    assert row[:4] == ["spnl-backend", "1", "4", "256.0"]
    assert row[4:9] == ["500 ms", "500 ms", "10.0 ms", "10.0 ms", "100.0"]
    assert row[9:] == ["128.0", "0", "0", "0"]
    assert cells(lines[4])[:2] == [
        "llama-cpp-python",
        "not run: not ready after 300 s (a \\| b)",
    ]
    assert "tokens counted from usage, server peak RSS 900 MB" in text
    assert "--interrupt_requests False" in text
    assert "First problems" not in text


def test_soak_table_lists_the_first_problems():
    bad = summary(16, truncated=1, problems=["truncated: cut: RemoteProtocolError"])
    results = [{"engine": "llama.cpp", "levels": [bad]}]
    text = serve.table(results, soak=True, threads=2, max_tokens=MAX, endpoint="completions")
    lines = text.splitlines()
    assert lines[0].count("|") == len(serve.SOAK_HEADER) + 1
    assert cells(lines[2]) == ["llama.cpp", "16", "4", "0", "0", "1", "512", "2 s"]
    assert "- llama.cpp, 16 clients: truncated: cut: RemoteProtocolError" in text
