"""bench/prep_stall.py's pure parts: the grammars it sends and its report."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import prep_stall
from spnl_backend.constrain.gbnf import to_lark


def test_the_chained_grammar_has_every_rule_and_converts():
    grammar = prep_stall.chain(50)
    assert grammar.count("::=") == 52  # root, r0 .. r50
    lark = to_lark(grammar)
    assert "R50" in lark  # the chain's rules are terminals
    assert lark.startswith("%llguidance {}")


def test_each_request_is_measured_and_reported():
    asked = prep_stall.requests([10, 20])
    assert [path for _, path, _ in asked] == ["/v1/completions"] * 2 + ["/v1/chat/completions"]
    result = {"status": 200, "s": 1.5, "median_ms": 2.0, "max_ms": 9.5, "probes": 3}
    table = prep_stall.report([("x", result)])
    assert "| x | 200 | 1.50 | 2.0 ms | 9.5 ms | 3 |" in table
