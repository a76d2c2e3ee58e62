"""bench/embed_stall.py's pure parts: the texts, the gaps it counts and its report."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import embed_stall


def test_texts_are_distinct_and_of_the_words_asked():
    texts = embed_stall.texts(40, 12)
    assert len(set(texts)) == 40
    assert {len(t.split()) for t in texts} == {13}  # the number, then 12 words
    assert texts == embed_stall.texts(40, 12)


def test_the_gaps_counted_are_those_that_overlap_the_batch():
    arrivals = [0.0, 1.0, 1.5, 4.0, 4.2, 9.0]
    assert embed_stall.gaps_during(arrivals, 1.2, 4.1) == pytest.approx([0.5, 2.5, 0.2])
    assert embed_stall.gaps_during(arrivals, 0.0, 9.0) == pytest.approx([1.0, 0.5, 2.5, 0.2, 4.8])


def test_the_report_names_every_figure():
    alone = {"median_gap_s": 0.012, "max_gap_s": 0.03, "short_s": 0.26, "batch_s": 9.5}
    together = {"max_gap_s": 0.4, "tokens": 120, "short_s": 1.1, "batch_s": 12.0}
    together["max_health_s"] = 0.021
    result = {"texts": 512, "tokens_per_text": 63.6, "alone": alone, "together": together}
    table = embed_stall.report(result)
    assert table.startswith("512 texts of 64 tokens")
    assert "| the stream's largest gap, with the batch | 400 ms |" in table
    assert "| 16-token request, with the batch and the stream | 1.10 s |" in table
    assert "| /health's largest latency, with the batch | 21 ms |" in table
