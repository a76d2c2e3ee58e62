"""bench/speculation.py's pure parts: the workloads' prompts, both servers' counts read from
their streams, the server commands, and the table's arithmetic; no server runs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import speculation


def test_each_workload_varies_its_requests_and_scales_for_quick():
    full, small = speculation.Sizes(), speculation.SMALL
    for workload in speculation.WORKLOADS:
        first, second = (speculation.messages(workload, i, full) for i in (0, 1))
        assert first != second  # no two concurrent requests are the same
    code = speculation.messages("code-edit", 0, full)[0]["content"]
    assert len(code.split("```")[0].splitlines()) >= 100  # a 100-line function
    rag = speculation.messages("rag", 0, full)
    assert len(rag) == 1 + 10 + 2  # the system prompt, 10 fragments, the question and ask
    assert len(rag[1]["content"]) == 1000  # spnl's l = 1000
    summary = speculation.messages("summary", 0, full)[0]["content"]
    assert len(summary.split()) > 1750
    assert len(speculation.messages("summary", 0, small)[0]["content"]) < len(summary)
    with pytest.raises(ValueError, match="unknown workload 'copy'"):
        speculation.messages("copy", 0, full)


def test_both_servers_counts_are_read_from_their_streams():
    ours = speculation.Outcome()
    speculation.read_chunk(ours, {"choices": [{"text": "a", "finish_reason": None}]}, 1.0)
    speculation.read_chunk(ours, {"choices": [{"text": "bc", "finish_reason": "length"}]}, 3.0)
    usage = {
        "completion_tokens": 9,
        "completion_tokens_details": {
            "accepted_prediction_tokens": 5,
            "rejected_prediction_tokens": 2,
        },
    }
    speculation.read_chunk(ours, {"choices": [], "usage": usage}, 4.0)
    assert (ours.first, ours.last, ours.text, ours.finish) == (1.0, 3.0, "abc", "length")
    assert (ours.tokens, ours.proposed, ours.accepted) == (9, 7, 5)
    theirs = speculation.Outcome()
    final = {
        "choices": [{"text": "x", "finish_reason": "stop"}],
        "usage": {"completion_tokens": 4},
        "timings": {"predicted_n": 4, "draft_n": 6, "draft_n_accepted": 2},
    }
    speculation.read_chunk(theirs, final, 2.0)
    assert (theirs.tokens, theirs.proposed, theirs.accepted) == (4, 6, 2)


def test_server_commands(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("")
    args = speculation.parse_args(["--llama-server", str(binary), "--quick"])
    assert (args.runs, args.tokens) == (1, 128)
    argv, env = speculation.server_argv("llama:ngram-mod", Path("m.gguf"), 8080, args)
    assert argv[argv.index("--spec-type") + 1] == "ngram-mod"
    assert argv[argv.index("-np") + 1] == "16"
    assert argv[argv.index("-t") + 1] == "2"
    assert env == {}
    plain, _ = speculation.server_argv("llama:none", Path("m.gguf"), 8080, args)
    assert "--spec-type" not in plain
    _, env = speculation.server_argv("ours:suffix", Path("m.gguf"), 8080, args)
    assert env["MISTRALRS_SPECULATIVE_METHOD"] == "suffix"
    assert env["OMP_NUM_THREADS"] == "2"
    with pytest.raises(SystemExit):
        speculation.parse_args(["--clients", "32"])


def test_a_row_sets_steps_against_no_speculation():
    base = {"tok_s": 50.0, "texts": ["t"], "aggregate_tok_s": 50.0, "ms_per_step": 20.0}
    r = {
        "tok_s": 100.0,
        "aggregate_tok_s": 100.0,
        "tokens": 101,
        "proposed": 80,
        "accepted": 60,
        "steps": 40,
        "ms_per_step": 25.0,
        "texts": ["t"],
    }
    row = speculation.row("code-edit", 1, "ours:ngram", r, base)
    # 2x over none; 80 proposed in 40 steps; a step costs 25 ms against none's 20 ms/token
    assert row[5:] == ["2.00×", 80, "60 (75%)", "2.0", "25.0 (1.25×)", "yes"]
