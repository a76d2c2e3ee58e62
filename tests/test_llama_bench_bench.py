"""bench/llama_bench.py's long-context parts: llama-bench's options and rows read, the
table of alternating runs; no engine runs (a stand-in script plays llama-bench)."""

import json
import sys
from pathlib import Path

import pytest
from fake_llama_bench import fake_llama_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import llama_bench

LONG = ["--depths", "16384", "32768", "--long-prompt", "16384", "--long-decode", "32"]


def test_llama_bench_runs_the_depths_in_one_call_and_the_prefill_in_another(tmp_path):
    args = llama_bench.parse_args(["--threads", "2", *LONG])
    binary = fake_llama_bench(tmp_path)
    result = llama_bench.run_llama_long(binary, tmp_path / "m.gguf", args)
    calls = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    assert calls[0][calls[0].index("-d") + 1] == "16384,32768"
    assert calls[0][calls[0].index("-p") + 1] == "0"
    assert calls[1][calls[1].index("-p") + 1] == "16384"
    assert all(c[c.index("-r") + 1] == "1" and c[c.index("-t") + 1] == "2" for c in calls)
    assert result["decode_d16384"] == pytest.approx(1000 / 17)
    assert result["decode_d32768"] == pytest.approx(1000 / 33)
    assert result["prefill"] == 1000.0


def test_a_failing_llama_bench_is_an_error_cell(tmp_path):
    binary = tmp_path / "llama-bench"
    binary.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    binary.chmod(0o755)
    args = llama_bench.parse_args(["--depths", "1024"])
    assert llama_bench.run_llama_long(binary, tmp_path / "m.gguf", args) == {
        "error": "error: failed to load model"
    }


def test_long_rows_give_medians_and_the_median_of_paired_ratios():
    args = llama_bench.parse_args(LONG)
    ours = [{"prefill": 600.0, "decode_d16384": 60.0}, {"prefill": 300.0, "decode_d16384": 50.0}]
    peer = [{"prefill": 400.0, "decode_d16384": 40.0}, {"prefill": 300.0, "decode_d16384": 20.0}]
    rows = llama_bench.long_rows("m", {"ours": ours, "llama.cpp": peer}, args)
    assert [r[1] for r in rows] == [
        "prefill, pp16384",
        "decode, tg32 @ d16384",
        "decode, tg32 @ d32768",
    ]
    assert rows[0][2:] == ["450.0", "350.0", "1.25x (1.00-1.50)"]
    assert rows[1][2:] == ["55.0", "30.0", "2.00x (1.50-2.50)"]
    assert rows[2][2:] == ["-", "-", "-"]


def test_an_errored_run_is_named_in_its_rows():
    args = llama_bench.parse_args(["--depths", "1024"])
    runs = {"ours": [{"error": "killed"}], "llama.cpp": [{"decode_d1024": 10.0}]}
    rows = llama_bench.long_rows("m", runs, args)
    assert rows[0][0] == "m (ours: killed)"
    assert rows[0][2:] == ["-", "10.0", "-"]


@pytest.mark.parametrize("bad", [["--depths", "0"], ["--long-prompt", "-1"], ["--long-runs", "0"]])
def test_counts_must_be_positive(bad, capsys):
    with pytest.raises(SystemExit):
        llama_bench.parse_args(bad)
    assert "positive counts" in capsys.readouterr().err


def test_wait_quiet_waits_for_a_low_load_and_no_pytest(monkeypatch):
    from bench import harness

    loads = iter([3.0, 0.4, 0.4, 0.3, 0.3])
    running = iter([True, False])  # asked only once the load is low
    sleeps = []
    monkeypatch.setattr(harness, "load_average", lambda: next(loads))
    monkeypatch.setattr(harness, "pytest_running", lambda: next(running))
    monkeypatch.setattr(harness.time, "sleep", sleeps.append)
    assert harness.wait_quiet(0.5) == 0.3  # the load it measured on leaving
    assert sleeps == [10, 10]  # a high load, then a pytest


def test_llama_bench_output_read():
    rows = [
        {"n_prompt": 1024, "n_gen": 0, "avg_ts": 300.0, "stddev_ts": 2.0, "build_commit": "c"},
        {"n_prompt": 0, "n_gen": 128, "avg_ts": 30.0, "stddev_ts": 0.5, "build_commit": "c"},
    ]
    result = llama_bench.parse_llama_bench(json.dumps(rows), "noise\npeak_rss_kb 2048\n")
    assert (result["prefill_tok_s"], result["prefill_tokens"]) == (300.0, 1024)
    assert (result["decode_tok_s"], result["decode_tokens"]) == (30.0, 128)
    assert result["peak_rss_mb"] == 2.0
    assert result["llama_cpp"]["build_commit"] == "c"
    command = llama_bench.llama_bench_command(Path("lb"), Path("m.gguf"), 1, 1024, 128, 3)
    assert command[:3] == ["/usr/bin/time", "-f", "peak_rss_kb %M"]
    assert " ".join(command[3:]) == "lb -m m.gguf -t 1 -p 1024 -n 128 -r 3 -o json"
