"""bench/spnl_speedup.py: its fragments and queries, and one run of each workload against a
tiny model's server (the numbers are not checked, only that every part runs and reports)."""

import random
import sys
from pathlib import Path

import pytest
from live_server import MODEL, TEMPLATE, LiveServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import spnl_speedup

from spnl_backend import BackendSettings, load_backend


def test_fragments_hold_one_code_and_are_seeded():
    docs, question, code = spnl_speedup.fragments(300, random.Random(4))
    again = spnl_speedup.fragments(300, random.Random(4))
    assert (docs, question, code) == again
    assert len(docs) == spnl_speedup.FRAGMENTS
    assert all(len(doc) == 300 for doc in docs)
    assert sum(code in doc for doc in docs) == 1
    assert question.startswith("Question: What is the access code")


def test_the_queries_are_spnls_shapes():
    rag = spnl_speedup.rag_query("spnl/m", ["a", "b"], "q?")
    cross = rag["repeat"]["g"]["input"]["cross"]
    assert [next(iter(part)) for part in cross] == ["system", "plus", "user", "user"]
    warm = spnl_speedup.warm_up_query("spnl/m", ["a", "b"])
    assert warm["map"]["metadata"]["max_tokens"] == 1
    judge = spnl_speedup.judge_query("spnl/m", ["e1", "e2"])
    assert judge["repeat"]["g"]["input"]["seq"][-1] == {
        "plus": [{"assistant": "e1"}, {"assistant": "e2"}]
    }


@pytest.fixture(scope="module")
def live(tiny):
    # Small blocks: the tiny tokenizer makes the prompts long for its 512 positions.
    settings = BackendSettings(device="cpu", paged_attn_block_size=8)
    backend = load_backend(str(tiny.hf("llama").path), settings=settings)
    backend.tokenizer.hf.chat_template = TEMPLATE
    server = LiveServer(backend)
    yield server
    server.stop()
    backend.close()


def test_each_workload_runs_against_a_server(live):
    rag = spnl_speedup.bench_rag(live.url, MODEL, 20, 1, random.Random(0), count=3)
    assert rag["hit"] == 1.0  # the warm-up makes every fragment hit
    assert rag["openai_ttft"] > 0
    assert rag["spnl_ttft"] > 0
    assert 0 <= rag["f1"] <= 100
    email = spnl_speedup.bench_email(live.url, MODEL, 32, 1, 2)
    assert email["spnl_ttft"] > 0
    exact = spnl_speedup.exact_answers(live.url, MODEL, 20, 1, random.Random(1), count=3)
    assert exact == {"same": 1, "all_hit": 1, "runs": 1}  # reordered in one context: exact
    table = spnl_speedup.table([["tiny", "rag", 20, {**rag, "exact": exact}]])
    assert "| tiny | rag | 20 |" in table
