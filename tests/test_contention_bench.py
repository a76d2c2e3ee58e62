"""bench/contention.py's pure parts: the decode budget, the competing processes, the
table's ratios."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import contention


def test_decode_is_counted_after_the_first_token_and_stops_at_its_budget(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(contention.time, "perf_counter", lambda: clock[0])

    def tokens(count, gap):
        for _ in range(count):
            clock[0] += gap
            yield None

    assert contention._within_budget(tokens(11, 0.25)) == 4.0  # 10 after the first, 2.5 s
    stream = tokens(10_000, 1.0)  # a token a second: stopped once 60 s have passed
    contention._within_budget(stream)
    made = sum(1 for _ in stream)
    assert made == 10_000 - (contention.BUDGET_S + 2)
    assert contention._within_budget(iter([None])) == 0.0


def test_busy_processes_run_while_asked_and_are_gone_after():
    import psutil

    before = {p.pid for p in psutil.process_iter()}
    with contention.busy(2):
        started = {p.pid for p in psutil.process_iter()} - before
        assert len(started) >= 2
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in started)  # fmt: skip


def test_the_table_compares_with_the_best_fixed_count_and_llama_cpp():
    rows = [
        {"model": "m", "load": 2, "threads": t, "engine": e, "decode_tok_s": v, "prefill_tok_s": 1}
        for e, values in (("ours", (40, 50, 45)), ("llama.cpp", (30, 10, 30)))
        for t, v in zip(("1", "2", "default"), values, strict=True)
    ]
    table = contention.table(rows, ["1", "2", "default"])
    assert "| m | 2 | default | 45.0 | 30.0 | 0.90x | 1.50x | 1.50x |" in table
