"""`spnl-backend info`: the table, --json, and one-line errors with exit code 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spnl_backend.cli import main

BAD_ENVIRONMENTS = [
    ({"MISTRALRS_PAGED_ATTN_BLOCK_SIZE": "33"}, ["MISTRALRS_PAGED_ATTN_BLOCK_SIZE", "'33'"]),
    ({"MISTRALRS_ISQ": "Q9K"}, ["MISTRALRS_ISQ", "'Q9K'", "Q4K"]),
    ({"MISTRALRS_PREFIX_CACHE_N": "-1"}, ["MISTRALRS_PREFIX_CACHE_N", "'-1'"]),
    (
        {"MISTRALRS_PAGED_ATTN_MEMORY_MB": "512", "MISTRALRS_PAGED_ATTN_CONTEXT_LEN": "2048"},
        ["MISTRALRS_PAGED_ATTN_MEMORY_MB", "MISTRALRS_PAGED_ATTN_CONTEXT_LEN"],
    ),
    ({"MISTRALRS_DEVICE": "cuda:7"}, ["MISTRALRS_DEVICE", "'cuda:7'"]),
]


def test_info_prints_a_table(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for text in ("MISTRALRS_PAGED_ATTN_BLOCK_SIZE", "platform", "paged_attn_reason", "kernels"):
        assert text in out


def test_info_json(monkeypatch, capsys):
    monkeypatch.setenv("MISTRALRS_ISQ", "q4_k_m")
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["settings"]["MISTRALRS_ISQ"] == {"value": "Q4K", "source": "env"}
    assert info["settings"]["MISTRALRS_PAGED_ATTN_BLOCK_SIZE"] == {"value": 32, "source": "default"}
    assert info["kv_budget"] == {"kind": "context_len", "value": 4096, "explicit": False}
    assert info["platform"]["device_type"] in ("cpu", "cuda", "mps")


@pytest.mark.parametrize(("env", "expected"), BAD_ENVIRONMENTS)
def test_bad_environment_is_one_line_and_exit_2(monkeypatch, capsys, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["info"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("spnl-backend: error: ")
    assert captured.err.count("\n") == 1
    for text in expected:
        assert text in captured.err


def test_console_script_is_installed_and_reports_errors_without_traceback():
    script = Path(sys.executable).parent / "spnl-backend"
    assert script.exists(), "install the package (pip install -e .) to get the console script"
    ok = subprocess.run([script, "info", "--json"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "MISTRALRS_PAGED_ATTN" in json.loads(ok.stdout)["settings"]
    bad = subprocess.run(
        [script, "info"],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "MISTRALRS_PAGED_ATTN_BLOCK_SIZE": "33"},
    )
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert "MISTRALRS_PAGED_ATTN_BLOCK_SIZE='33'" in bad.stderr


def _generate(tiny, *args: str) -> list[str]:
    return ["generate", "--model", str(tiny.hf("llama").path), "--temperature", "0", *args]


def test_generate_streams_one_prompt(tiny, capsys, monkeypatch):
    monkeypatch.setenv("MISTRALRS_DEVICE", "cpu")
    assert main(_generate(tiny, "--max-tokens", "6", "The capital of France is")) == 0
    expected = (
        tiny.backend("llama").generate("The capital of France is", max_tokens=6, temperature=0).text
    )
    assert capsys.readouterr().out == expected + "\n"


def test_generate_json_for_several_prompts(tiny, capsys, monkeypatch):
    monkeypatch.setenv("MISTRALRS_DEVICE", "cpu")
    assert main(_generate(tiny, "--max-tokens", "4", "--json", "Once upon", "def add")) == 0
    results = json.loads(capsys.readouterr().out)
    assert [len(r["token_ids"]) for r in results] == [4, 4]
    assert results[0]["usage"]["completion_tokens"] == 4
    assert results[0]["finish_reason"] == "length"


def test_generate_prints_several_prompts_in_order(tiny, capsys, monkeypatch):
    monkeypatch.setenv("MISTRALRS_DEVICE", "cpu")
    assert main(_generate(tiny, "--max-tokens", "3", "first one", "second")) == 0
    out = capsys.readouterr().out
    assert out.index("--- 1: 'first one'") < out.index("--- 2: 'second'")


def test_generate_rejects_bad_parameters_before_loading(capsys):
    assert main(["generate", "--model", "/does/not/matter", "--top-p", "2", "hi"]) == 2
    assert "top_p=2.0" in capsys.readouterr().err
