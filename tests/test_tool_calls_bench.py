"""bench/tool_calls.py's pure parts: the requests, what counts as a whole and valid call,
the template's default place and the table."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import tool_calls


def test_requests_differ_after_the_same_earlier_turns():
    first, second = tool_calls.body("m", 0), tool_calls.body("m", 21)
    assert first["messages"][:-1] == second["messages"][:-1]
    assert first["messages"][-1] != second["messages"][-1]
    assert first["tool_choice"] == "required"
    assert first["parallel_tool_calls"] is False
    shown = [m for m in first["messages"] if m.get("tool_calls")]
    assert [json.loads(m["tool_calls"][0]["function"]["arguments"])["unit"] for m in shown] == [
        "celsius",
        "fahrenheit",
    ]


def test_a_call_is_whole_once_it_parses_and_valid_only_against_the_schema():
    assert not tool_calls.parses('{"city": "Lima", "unit": "cel')
    assert tool_calls.parses('{"city": "Lima", "unit": "celsius"}')
    assert tool_calls.valid("get_weather", '{"city": "Lima", "unit": "celsius"}')
    assert not tool_calls.valid("get_weather", '{"city": "Lima", "unit": "kelvin"}')
    assert not tool_calls.valid("get_weather", '{"city": "' + "x" * 25 + '", "unit": "celsius"}')
    assert not tool_calls.valid("other", '{"city": "Lima", "unit": "celsius"}')


def test_the_template_is_found_in_llama_cpps_tree(tmp_path):
    server = tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.touch()
    assert tool_calls.default_template(server) is None
    template = tmp_path / "llama.cpp" / tool_calls.QWEN_TEMPLATE
    template.parent.mkdir(parents=True)
    template.write_text("{{ tools }}<tool_call>")
    assert tool_calls.default_template(server) == template
    assert tool_calls.default_template(None) is None


def test_report_counts_valid_calls_and_streams_that_ended_as_asked():
    class Args:
        requests, threads, template = 2, 2, Path("qwen.jinja")

    ok = {"named": 0.1, "whole": 0.2, "valid": True, "reason": "tool_calls", "calls": 1}
    more = {"named": 0.3, "whole": 0.4, "valid": True, "reason": "length", "calls": 3}
    text = tool_calls.report(
        {"spnl-backend": {1: [ok, ok]}, "llama-server": {1: [ok, more]}}, Args()
    )
    assert "| spnl-backend | 1 | 0.100 s | 0.100 s | 0.200 s | 0.200 s | 2/2 | 2/2 |" in text
    assert "| llama-server | 1 |" in text
    assert "| 2/2 | 1/2 |" in text
    assert "not run: gone" in tool_calls.report({"llama-server": {"error": "gone"}}, Args())
