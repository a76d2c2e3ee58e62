"""bench/profile_decode.py's pure parts: the timers and the table; no engine runs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import profile_decode


def test_timers_count_calls_and_time_even_when_the_call_raises():
    timers = profile_decode.Timers()
    assert timers.timed("a", lambda x: x + 1, 1) == 2

    def fails():
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        timers.timed("a", fails)
    seconds, calls = timers.snapshot()
    assert calls == {"a": 2}
    assert seconds["a"] >= 0


def test_table_puts_the_untimed_rest_under_python():
    result = {
        "model": "m.gguf",
        "threads": 2,
        "tokens": 32,
        "ms_per_token": 20.0,
        "parts": {
            "product 64 x 32 (Q8_0)": {"ms": 10.0, "calls": 1.0, "gb_s": 20.0},
            "attention": {"ms": 4.0, "calls": 18.0, "gb_s": None},
        },
        "bandwidth": {"gb_s": 25.0, "method": "bench/read_bound.c"},
        "weight_mb": 247.0,
    }
    text = profile_decode.table(result)
    assert "| product 64 x 32 (Q8_0) | 1 | 10.00 | 50% | 20.0 GB/s |" in text
    assert "| attention | 18 | 4.00 | 20% | |" in text
    assert "| Python, torch ops, sampling | | 6.00 | 30% | |" in text
    assert "| one decode token | | 20.00 | 100% | |" in text
    assert "50.0 tok/s" in text
    assert "Read bandwidth: 25.0 GB/s (bench/read_bound.c); 247 MB" in text
    assert "native layer blocks" not in text  # not measured: not claimed
    text = profile_decode.table({**result, "blocks_ms_per_token": 15.0})
    assert "with the native layer blocks" in text
    assert "a token took 15.00 ms" in text


def test_prefill_table_shares_the_prefill_and_rates_the_products():
    result = {
        "model": "m.gguf",
        "threads": 2,
        "prompt_tokens": 1000,
        "ms": 2000.0,
        "parts": {
            "product 64 x 32 (Q4_K)": {"ms": 1000.0, "calls": 4, "gmac_s": 150.0},
            "attention": {"ms": 500.0, "calls": 4, "gmac_s": None},
        },
    }
    text = profile_decode.prefill_table(result)
    assert "| product 64 x 32 (Q4_K) | 4 | 1000.0 | 50% | 150.0 |" in text
    assert "| attention | 4 | 500.0 | 25% | |" in text
    assert "| Python, torch ops, sampling | | 500.0 | 25% | |" in text
    assert "| the whole prefill | | 2000.0 | 100% | |" in text
    assert "a 1000-token prompt" in text
    assert "500.0 tok/s" in text


def test_a_prefill_of_no_tokens_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["profile_decode.py", "--prefill", "0"])
    with pytest.raises(SystemExit):
        profile_decode.main()
    assert "at least 1 token" in capsys.readouterr().err


def test_batch_table_shares_a_step_and_rates_its_products():
    result = {
        "model": "m.gguf",
        "threads": 1,
        "batch": 16,
        "clock": "CPU",
        "tokens": 16,
        "ms_per_token": 100.0,
        "blocks_ms_per_token": 80.0,
        "parts": {
            "product 64 x 32 (Q5_0)": {"ms": 60.0, "calls": 26.0, "gmac_s": 130.0},
            "attention": {"ms": 10.0, "calls": 26.0, "gmac_s": None},
        },
    }
    text = profile_decode.batch_table(result)
    assert "| product 64 x 32 (Q5_0) | 26 | 60.00 | 60% | 130.0 |" in text
    assert "| Python, torch ops, sampling | | 30.00 | 30% | |" in text
    assert "| one decode step | | 100.00 | 100% | |" in text
    assert "16 sequences, CPU time" in text
    assert "160.0 tok/s" in text  # 16 tokens a step
    assert "a step took 80.00 ms" in text


@pytest.mark.parametrize(
    ("arguments", "message"),
    [(["--batch", "0"], "at least 1 sequence"), (["--batch", "4", "--cpu-time"], "--threads 1")],
)
def test_a_batch_profile_is_refused_before_loading(monkeypatch, capsys, arguments, message):
    monkeypatch.setattr(sys, "argv", ["profile_decode.py", "--gguf", "absent.gguf", *arguments])
    with pytest.raises(SystemExit) as stopped:
        profile_decode.main()
    assert message in capsys.readouterr().err + str(stopped.value)
