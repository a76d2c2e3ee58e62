"""bench/structured.py's pure parts: the validity check, the compile schemas, the table."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import structured


def test_valid_parses_and_validates_against_the_schema():
    person = {"name": "A", "age": 3, "city": "B", "bio": "x" * 100, "hobbies": ["c"]}
    assert structured.valid(json.dumps(person))
    assert not structured.valid(json.dumps({**person, "age": -1}))
    assert not structured.valid(json.dumps(person)[:-1])  # cut short
    assert not structured.valid("")


def test_compile_schemas_differ_from_each_other_and_from_the_measured_one():
    schemas = [json.dumps(structured.other_schema(i)) for i in range(3)]
    assert len({*schemas, json.dumps(structured.SCHEMA)}) == 4


def test_the_table_gives_the_change_per_batch_and_a_missing_batch_as_such():
    ours = {
        "engine": "spnl-backend",
        "first_compile_s": 4.0,
        "compile_ms": 1.2,
        "free_1": 60.0,
        "schema_1": 57.0,
        "free_16": 6.0,
        "schema_16": 5.7,
        "ended": 16,
        "valid": 15,
    }
    theirs = {k: v for k, v in ours.items() if not k.endswith("_16")} | {"engine": "llama.cpp"}
    text = structured.table([ours, theirs, {"engine": "x", "error": "boom"}], threads=2)
    assert "| spnl-backend | 1 | 60.0 | 57.0 | -5.0% | 4.00 s | 1.2 ms | 16, 15 |" in text
    assert "| llama.cpp | 16 | single-sequence API |" in text
    assert "not run: boom" in text


def test_durations_under_a_second_are_in_milliseconds():
    assert structured._duration(0.0003) == "0.3 ms"
    assert structured._duration(4.084) == "4.08 s"
