"""bench/replicas.py's workload and arguments (its smoke mode starts replicas and the
router: run by hand, ``python bench/replicas.py --smoke --model PATH``)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import replicas


def test_each_document_set_recurs_in_two_sessions():
    workload = replicas.Workload(
        sessions=8, turns=4, docs_per_session=3, doc_words=10, max_tokens=4
    )
    sets = replicas.documents(workload)
    assert len(sets) == 8
    assert sets == replicas.documents(workload)  # seeded
    assert all(sets[i] == sets[i + 4] for i in range(4))
    assert len({tuple(s) for s in sets}) == 4
    assert all(len(s) == 3 and all(len(d.split()) == 12 for d in s) for s in sets)
    messages = replicas.rag_messages(sets[0], "q?")
    assert [m["role"] for m in messages] == ["system", "user", "user", "user", "user"]
    assert messages[-1]["content"] == "q?"


def test_percentiles_and_the_rows_figures():
    assert replicas.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert replicas.percentile([float(i) for i in range(101)], 0.99) == 99.0
    tally = replicas.Tally(ttfts=[0.1, 0.3], prompt=200, cached=50, pic=0, tier=20)
    tally.completion = 40
    assert replicas.row("rr", tally, 2.0) == [
        "rr",
        "25.0%",
        "0.0%",
        "10.0%",
        "200",
        "300",
        "20.0",
        "2",
        "0",
    ]


def test_smoke_needs_a_model_and_counts_are_checked(capsys):
    with pytest.raises(SystemExit):
        replicas.parse_args(["--smoke"])
    assert "--smoke needs --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replicas.parse_args(["--replicas", "0"])
    assert "--replicas must be at least 1" in capsys.readouterr().err
    args = replicas.parse_args(["--smoke", "--model", "x"])
    assert (args.replicas, args.sessions, args.max_tokens) == (2, 2, 2)
    assert args.chat_template == replicas.SMOKE_TEMPLATE
