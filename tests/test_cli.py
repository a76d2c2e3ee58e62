"""`spnl-backend info`: the table, --json, and one-line errors with exit code 2."""

import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spnl_backend import log
from spnl_backend.cli import main
from spnl_backend.log import LOGGER_NAME

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
    # Info events (settings.resolved) may come first; the error is one line, the last.
    said = [line for line in captured.err.splitlines() if not line.startswith("[info")]
    assert len(said) == 1, captured.err
    assert said[0].startswith("spnl-backend: error: ")
    assert captured.err.endswith(said[0] + "\n")
    for text in expected:
        assert text in said[0]


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


@pytest.mark.parametrize("seed", [str(2**70), "-1"])
def test_generate_refuses_a_seed_out_of_range_in_one_line(capsys, seed):
    assert main(["generate", "--model", "/does/not/matter", "--seed", seed, "hi"]) == 2
    err = capsys.readouterr().err
    assert f"seed={seed}" in err
    assert "Traceback" not in err


def _mapped(pid: int, name: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return name in maps.read()
    except OSError:
        return False


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"the command never got to {what}")
        time.sleep(0.01)


@pytest.mark.skipif(sys.platform != "linux", reason="follows the child through /proc")
@pytest.mark.parametrize("stage", ["importing torch", "loading the model", "generating"])
def test_ctrl_c_exits_130_with_one_line(tiny, stage, foreground):
    """Ctrl-C while torch imports, while the model loads, or while tokens stream."""
    script = Path(sys.executable).parent / "spnl-backend"
    command = [script, "-v", *_generate(tiny, "--max-tokens", "0", "Once upon a time")]
    env = {"PATH": "/usr/bin:/bin", "MISTRALRS_DEVICE": "cpu", "HOME": str(Path.home())}
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    printed, logged = [], []
    readers = [
        threading.Thread(target=lambda: printed.append(child.stdout.read(1))),
        threading.Thread(target=lambda: logged.extend(iter(child.stderr.readline, b""))),
    ]
    for reader in readers:
        reader.start()
    ready = {
        "importing torch": lambda: _mapped(child.pid, "libtorch"),
        "loading the model": lambda: any(b"model.resolved" in line for line in logged),
        "generating": lambda: bool(printed),
    }[stage]
    _wait_for(ready, stage)
    child.send_signal(signal.SIGINT)
    for reader in readers:
        reader.join(timeout=120)
    out = b"".join(printed) + child.stdout.read()
    err = b"".join(logged).decode()
    child.wait(timeout=120)
    if child.returncode == 0:
        pytest.skip("the command finished before Ctrl-C")
    assert child.returncode == 130, err
    assert err.strip().splitlines()[-1] == "spnl-backend: interrupted"
    assert "Traceback" not in err
    assert out in (b"", b"\n") or out.endswith(b"\n")  # a streamed line is ended


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal (tqdm then draws)."""

    def isatty(self):
        return True


def test_the_load_progress_bar_ends_at_100_percent_on_its_own_line(capsys):
    from spnl_backend.loader.progress import TqdmProgress

    terminal = _Terminal()
    with contextlib.redirect_stderr(terminal):
        progress = TqdmProgress()
        for done in range(237):
            progress("weights", done, 236)
    drawn = terminal.getvalue()
    assert "236/236" in drawn.rsplit("\r", 1)[-1]
    assert drawn.endswith("\n")


def test_a_step_with_nothing_to_count_shows_its_time_and_ends_its_line(monkeypatch):
    from spnl_backend.loader import progress as module

    monkeypatch.setattr(module, "TICK_S", 0.01)
    terminal = _Terminal()
    with contextlib.redirect_stderr(terminal):
        progress = module.TqdmProgress()
        with module.step(progress, "compiling the CPU kernels"):
            time.sleep(0.1)  # the bar redraws meanwhile: its time runs
        with module.step(progress, "converting the tokenizer", happens=False):
            pass
    drawn = terminal.getvalue()
    assert drawn.count("compiling the CPU kernels") > 2
    assert drawn.rsplit("\r", 1)[-1].startswith("compiling the CPU kernels: 00:00")
    assert drawn.endswith("\n")
    assert "converting" not in drawn  # a cached step draws nothing


def test_closing_the_progress_ends_open_lines_and_draws_no_more():
    from spnl_backend.loader.progress import TqdmProgress

    terminal = _Terminal()
    with contextlib.redirect_stderr(terminal):
        progress = TqdmProgress()
        progress("compiling the CPU kernels", 0, 1)
        progress("weights", 10, 236)
        progress.close()  # an interruption: its message starts on a line of its own
        after = len(terminal.getvalue())
        progress("weights", 20, 236)
    drawn = terminal.getvalue()
    assert drawn.endswith("\n")
    assert len(drawn) == after


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="a pseudo-terminal")
def test_a_first_run_shows_its_steps_and_ctrl_c_ends_the_bar_first(tiny, tmp_path, foreground):
    """On a terminal, a first run (nothing cached) shows the kernel compile as a bar; Ctrl-C
    during it ends the bar's line before the one-line message."""
    import fcntl
    import pty
    import struct
    import termios

    script = Path(sys.executable).parent / "spnl-backend"
    command = [str(script), *_generate(tiny, "--max-tokens", "2", "Once upon a time")]
    env = {"PATH": "/usr/bin:/bin", "MISTRALRS_DEVICE": "cpu", "HOME": str(Path.home())}
    env["XDG_CACHE_HOME"] = str(tmp_path)  # nothing compiled yet
    main_fd, terminal = pty.openpty()
    # A terminal of 30 x 100 (a new pseudo-terminal has no size, and tqdm then draws nothing).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    child = subprocess.Popen(command, stdin=terminal, stdout=terminal, stderr=terminal, env=env)
    os.close(terminal)
    drawn = b""
    deadline = time.monotonic() + 300
    while b"compiling the CPU kernels" not in drawn and time.monotonic() < deadline:
        try:
            drawn += os.read(main_fd, 4096)
        except OSError:
            break
    assert b"compiling the CPU kernels" in drawn, drawn[-2000:]
    child.send_signal(signal.SIGINT)
    while True:
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # the child has closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    child.wait(timeout=120)
    os.close(main_fd)
    text = drawn.decode(errors="replace")
    assert child.returncode == 130, text[-2000:]
    message = "spnl-backend: interrupted"
    assert message in text
    before = text[: text.rindex(message)]
    assert before.endswith("\n"), repr(text[-400:])


@pytest.mark.parametrize(
    ("flags", "level"),
    [([], logging.INFO), (["-q"], logging.WARNING), (["-v"], logging.DEBUG)],
)
def test_the_console_shows_info_events_unless_told(flags, level, monkeypatch, capsys):
    logger = logging.getLogger(LOGGER_NAME)
    monkeypatch.setattr(logger, "level", logger.level)  # restored after the test
    monkeypatch.setattr(log, "_pinned", False)
    monkeypatch.setattr(log, "_verbose", False)
    monkeypatch.delenv("MISTRALRS_VERBOSE", raising=False)
    assert main([*flags, "info"]) == 0
    assert logger.getEffectiveLevel() == level
    # -v's debug events outlast the settings' load, and the environment is left alone
    assert log._verbose == (flags == ["-v"])
    assert "MISTRALRS_VERBOSE" not in os.environ
