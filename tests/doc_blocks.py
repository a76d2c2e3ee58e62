"""The code blocks of the documentation, and how each kind is checked (tests/test_docs.py
states the convention)."""

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where the examples address a server; the tests point these at theirs.
EXAMPLE_ADDRESSES = ("127.0.0.1:8000", "localhost:8000")
SEPARATORS = {"&&", "||", ";", "&", "|"}
PYTHON_TIMEOUT_S = 600
SHELLS = ("bash", "sh", "console")
LIVE_TIMEOUT_S = 600  # a block waits for its server, whose first load converts the tokenizer
STOP_S = 60  # for a server to stop on SIGTERM (its grace period is 30 s)
_STARTS_SERVER = re.compile(r"spnl-backend serve\b[^\n#]*&(?!&)")  # in the background

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[^\s`]*)")  # any info after the language too


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str  # "" where the fence names none
    text: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def needs_server(self) -> bool:
        return any(address in self.text for address in EXAMPLE_ADDRESSES)


def blocks(path: Path) -> Iterator[Block]:
    """The fenced blocks of a markdown file, their indentation (a block inside a list
    item) removed."""
    lines = path.read_text().splitlines()
    start = None
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if fence and start is None:
            start, indent, lang, body = number, len(fence["indent"]), fence["lang"], []
        elif start is not None and line.strip() == "```":
            yield Block(path, start, lang, "\n".join(body) + "\n")
            start = None
        elif start is not None:
            body.append(line[indent:] if line[:indent].strip() == "" else line)
    assert start is None, f"{path}:{start}: a code block is never closed"


def commands(script: str) -> list[list[str]]:
    """A shell script's commands as word lists: continuation lines joined, comments
    dropped, `&&`, `;`, `&` and `|` separating commands as lines do."""
    result: list[list[str]] = []
    for line in _logical_lines(script):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for word in lexer:
            if word in SEPARATORS:
                result.append(words)
                words = []
            else:
                words.append(word)
        result.append(words)
    return [words for words in result if words]


def _logical_lines(script: str) -> Iterator[str]:
    """Physical lines joined where a line ends in a backslash or a quote is still open."""
    pending = ""
    for line in script.splitlines():
        pending += line + "\n"
        if pending.endswith("\\\n"):
            pending = pending[:-2] + " "
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quotation still open: the line goes on
            continue
        yield pending
        pending = ""
    assert not pending.strip(), f"unterminated shell text: {pending!r}"


def assignments(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """`NAME=VALUE` words before a command, and the command."""
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words[0].split("=", 1)
        env[name] = value
        words = words[1:]
    return env, words


def parse_cli(args: list[str]) -> argparse.Namespace:
    """`spnl-backend ARGS` through the command line's own parser."""
    from spnl_backend.cli import _build_parser

    return _parse_or_fail(lambda: _build_parser().parse_args(args), "spnl-backend", args)


class _ParsedError(Exception):
    """Raised by a bench script's parser once it has parsed: nothing past it runs."""


def parse_bench(script: str, args: list[str]) -> None:
    """`python bench/SCRIPT.py ARGS` through that script's parser, which its `main()`
    builds: `main()` runs until the parser has read the arguments, and no further."""
    sys.path.insert(0, str(ROOT / "bench"))  # the scripts import `harness` as a top module
    try:
        module = importlib.import_module(f"bench.{script}")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **kw):
        original(self, *a, **kw)
        raise _ParsedError

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
        mock.patch.object(sys, "argv", [f"bench/{script}.py", *args]),
    ):
        try:
            _parse_or_fail(module.main, f"bench/{script}.py", args)
        except _ParsedError:
            return
    raise AssertionError(f"bench/{script}.py: main() never parsed its arguments")


def _parse_or_fail(parse, program: str, args: list[str]):
    """argparse reports a bad argument by exiting; a test reports it as a failure."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse()
    except SystemExit as exc:
        raise AssertionError(f"{program} {shlex.join(args)}: {stderr.getvalue()}") from exc


def ci_commands() -> list[list[str]]:
    """What .ci/run runs, pip's --quiet aside."""
    return [[w for w in words if w != "--quiet"] for words in commands(_ci_script())]


def _ci_script() -> str:
    return (ROOT / ".ci" / "run").read_text()


def missing_modules(code: str) -> list[str]:
    """Top-level packages the code imports that are not installed (spnl, say, which the
    dev extra installs only on Linux x86-64)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return sorted(name for name in names if importlib.util.find_spec(name) is None)


def run_python(code: str, env: dict[str, str], cwd: Path) -> None:
    """A python example in a fresh interpreter; it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=PYTHON_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr}"


def example_env() -> dict[str, str]:
    """The environment an example runs in: this one, with this checkout first on the
    path (the venv's editable install may point at another)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_python_example(code: str, env: dict[str, str], cwd: Path) -> None:
    missing = missing_modules(code)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, which is not installed here")
    run_python(code, env, cwd)


def check_shell(script: str, env: dict[str, str], cwd: Path) -> None:
    """Every command of a shell example, checked by what it runs."""
    env = dict(env)
    for words in commands(script):
        settings, words = assignments(words)
        check_settings(settings)
        if words[0] == "export":
            env.update(assignments(words[1:])[0])
            continue
        program = Path(words[0]).name
        if program not in _PROGRAMS:
            raise AssertionError(f"{shlex.join(words)}: no check for {program!r} commands")
        _PROGRAMS[program](words, env, cwd)


def check_settings(variables: dict[str, str]) -> None:
    """`MISTRALRS_*=VALUE` before a command: each a setting, each value one it accepts."""
    from spnl_backend import BackendSettings
    from spnl_backend.settings.backend_settings import unknown_env_variables

    ours = {k: v for k, v in variables.items() if k.startswith("MISTRALRS_")}
    with mock.patch.dict(os.environ, ours):
        BackendSettings()  # raises SettingsError naming a value it does not accept
        unknown = set(unknown_env_variables()) & set(ours)
    assert not unknown, f"not settings: {sorted(unknown)}"


def _spnl_backend(words: list[str], env: dict[str, str], cwd: Path) -> None:
    parse_cli(words[1:])


def _python(words: list[str], env: dict[str, str], cwd: Path) -> None:
    args = words[1:]
    if args[:1] == ["-c"]:
        run_python_example(args[1], env, cwd)
    elif re.fullmatch(r"bench/\w+\.py", args[0]):
        parse_bench(Path(args[0]).stem, args[1:])
    elif args[0] == "-m" and args[1].startswith("bench."):
        parse_bench(args[1].removeprefix("bench."), args[2:])
    else:
        _setup(words, env, cwd)


def _setup(words: list[str], env: dict[str, str], cwd: Path) -> None:
    """The set-up commands (a venv, pip, the tests): CI runs them, in .ci/run."""
    assert words in ci_commands(), f"{shlex.join(words)}: not a command .ci/run runs"


def _curl(words: list[str], env: dict[str, str], cwd: Path) -> None:
    """Run against the live server; an HTTP error fails it."""
    command = [words[0], "--fail-with-body", "--max-time", "300", *words[1:]]
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{shlex.join(words)}: exit {done.returncode}\n{done.stdout}"


_PROGRAMS = {
    "spnl-backend": _spnl_backend,
    "python": _python,
    "python3": _python,
    "pip": _setup,
    "curl": _curl,
}


# A bench invocation quoted in prose, settings before it allowed.
_INLINE_BENCH = re.compile(r"(?:[A-Z_][A-Z0-9_]*=\S+ )*python (?:bench/\w+\.py|-m bench\.\w+)\b")


def inline_bench_commands(path: Path) -> Iterator[tuple[int, str]]:
    """`python bench/...` quoted in a page's prose, with its line: its optional parts
    (`[--gguf FILE]`) written out, so that they are parsed too."""
    text = re.sub(r"^ *```.*?^ *```", _blank, path.read_text(), flags=re.MULTILINE | re.DOTALL)
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        command = " ".join(span[1].split())
        if _INLINE_BENCH.match(command):
            line = text.count("\n", 0, span.start()) + 1
            yield line, command.replace("[", "").replace("]", "")


def _blank(match: re.Match) -> str:
    """A fenced block's text, as many empty lines: later lines keep their numbers."""
    return "\n" * match[0].count("\n")


# ---- the examples that serve: run as a user runs them --------------------------------------


def is_live(block: Block) -> bool:
    """A block that starts a server in the background, or talks to one."""
    if block.lang == "python":
        return block.needs_server
    starts = _STARTS_SERVER.search(block.text) is not None
    return block.lang in SHELLS and (block.needs_server or starts)


class LiveUser:
    """A user at a terminal in the clone after the set-up, running a page's examples one
    after another: the folder, the exported variables and the background servers carry
    over from block to block. Only the environment is the tests': the port, and curl
    failing on an HTTP error (exit 22) where a user would read the error."""

    def __init__(self, tmp: Path, port: int) -> None:
        self.tmp, self.port = tmp, port
        self.cwd = tmp / "clone"
        self.cwd.mkdir()
        (self.cwd / ".venv").symlink_to(sys.prefix)  # what command 1 made
        (tmp / ".curlrc").write_text("fail\n")
        self.env = {**example_env(), "CURL_HOME": str(tmp)}
        self.groups: list[int] = []  # a process group per shell block

    def run(self, block: Block) -> None:
        text = block.text.replace(":8000", f":{self.port}")
        text = text.replace("--port 8000", f"--port {self.port}")
        if block.lang == "python":
            run_python_example(text, self.env, self.cwd)
        elif not _python_c_missing(text):  # spnl, say, where it is not installed
            self._run_shell(block, text)
            self.env.update(_exported(text))

    def _run_shell(self, block: Block, text: str) -> None:
        out, err = self.tmp / f"{block.line}.out", self.tmp / f"{block.line}.err"
        with out.open("w") as stdout, err.open("w") as stderr:  # files: a server keeps them
            shell = subprocess.Popen(
                ["bash", "-e", "-o", "pipefail", "-c", text],
                cwd=self.cwd,
                env=self.env,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        self.groups.append(shell.pid)
        try:
            code: int | str = shell.wait(LIVE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = f"none: still running after {LIVE_TIMEOUT_S} s"
        said = f"{out.read_text()[-2000:]}\n{err.read_text()[-3000:]}"
        assert code == 0, f"{block.name}: exit {code}\n{said}"
        assert out.read_text().strip(), f"{block.name}: printed nothing\n{said}"

    def stop_servers(self) -> None:
        """SIGTERM to what the blocks left running (a script's background job ignores
        SIGINT), SIGKILL to what has not stopped after STOP_S."""
        for group in self.groups:
            _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        while any(map(group_alive, self.groups)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for group in self.groups:
            _signal_group(group, signal.SIGKILL)


def _python_c_missing(script: str) -> list[str]:
    codes = [words[2] for words in commands(script) if words[1:2] == ["-c"]]
    return [name for code in codes for name in missing_modules(code)]


def _exported(script: str) -> dict[str, str]:
    exported: dict[str, str] = {}
    for words in commands(script):
        if words[0] == "export":
            exported.update(assignments(words[1:])[0])
    return exported


def _signal_group(group: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, number)


def group_alive(group: int) -> bool:
    """Whether a process of the group still runs (a zombie, left for init to reap, does
    not)."""
    if not Path("/proc/self/stat").is_file():
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _parent, process_group = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # it ended while being read
        if process_group == str(group) and state != "Z":
            return True
    return False
