"""bench/kv_tier.py's pure parts: a row of the table, and a failed step shown as such."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import kv_tier


def test_a_row_gives_ratios_against_cold_and_pool():
    result = {
        "first": {"ttft": 1.0, "pool_ttft": 0.02, "prompt_tokens": 1000, "tier_tokens": 0},
        "cached": {"ttft": 0.03, "tier_tokens": 992},
        "disk": {"ttft": 0.04, "tier_tokens": 992},
        "bytes_per_token": 18438.4,
    }
    row = kv_tier.row("m.gguf", "1k", result)
    assert row[:7] == ["m.gguf", "1k", "1000", "1,000 ms", "20 ms", "30 ms", "40 ms"]
    assert row[7:] == ["3%", "1.50x", "992", "18,438"]
    assert len(row) == len(kv_tier.HEADER)


def test_a_failed_step_is_a_row_that_says_so():
    result = {"first": {"ttft": 1.0}, "cached": {"error": "boom"}, "disk": {}, "bytes_per_token": 0}
    row = kv_tier.row("m.gguf", "4k", result)
    assert row[2] == "not run: boom"
    assert len(row) == len(kv_tier.HEADER)
    assert kv_tier.row("m.gguf", "rag", {"error": "no model"})[2] == "not run: no model"
