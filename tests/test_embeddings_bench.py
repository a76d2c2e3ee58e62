"""bench/embeddings.py's pure parts: the texts, the table and the servers' agreement."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import embeddings


def test_texts_cycle_through_sizes_and_repeat_the_same():
    texts = embeddings.texts(10)
    assert [len(t.split()) for t in texts[:5]] == [8, 16, 32, 64, 120]
    assert texts == embeddings.texts(10)
    assert len(set(texts)) == 10


def test_report_rates_ratios_and_agreement():
    class Args:
        threads = 2

    results = {
        "spnl-backend": {"rates": {1: 20.0, 64: 90.0}, "vectors": [[1.0, 0.0], [0.0, 1.0]]},
        "llama-server": {"rates": {1: 10.0, 64: 60.0}, "vectors": [[1.0, 0.0], [0.6, 0.8]]},
    }
    text = embeddings.report(results, [1, 64], Args(), 2)
    assert "| spnl-backend | 20.0 | 90.0 |" in text
    assert "batch 64: 1.50x llama-server." in text
    assert "mean cosine similarity 0.9000, lowest 0.8000" in text
    failed = embeddings.report({"llama-server": {"error": "gone"}}, [1], Args(), 2)
    assert "not run: gone" in failed
