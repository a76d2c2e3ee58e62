"""``spnl-backend chat`` in a real terminal (tmux): streamed answers, the conversation
kept and saved, line editing, Ctrl-C stopping an answer, Ctrl-D leaving."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spnl_backend.terminal_chat import Conversation

TEMPLATE = (
    "<bos>{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
    pytest.mark.skipif(sys.platform != "linux", reason="a terminal"),
]


class Tmux:
    def __init__(self, socket: Path, command: str) -> None:
        self.base = ["tmux", "-S", str(socket)]
        subprocess.run(
            [*self.base, "new-session", "-d", "-x", "160", "-y", "50", command], check=True
        )

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", *keys], check=True)

    def screen(self) -> str:
        result = subprocess.run(
            [*self.base, "capture-pane", "-p", "-S", "-1000"], capture_output=True, text=True
        )
        return result.stdout

    def wait_for(self, predicate, what: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"waited {timeout} s for {what}; the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True)


def _model_with_template(tiny, tmp_path: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny.hf("llama").path, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return model


def _chat(model: Path, tmp_path: Path, options: str) -> Tmux:
    """``spnl-backend chat`` in a tmux terminal; its exit status shown after it."""
    script = Path(sys.executable).parent / "spnl-backend"
    command = (
        f"MISTRALRS_DEVICE=cpu XDG_CACHE_HOME={tmp_path / 'cache'} {script} chat "
        f"--model {model} {options}; echo EXIT=$?; sleep 60"
    )
    return Tmux(tmp_path / "tmux.sock", command)


def test_a_conversation_in_a_real_terminal(tiny, tmp_path):
    model = _model_with_template(tiny, tmp_path)
    saved = tmp_path / "conversation.json"
    tmux = _chat(model, tmp_path, "--temperature 0 --max-tokens 6 --system 'be brief'")
    try:
        prompts = lambda n: lambda s: s.count(">>>") >= n  # noqa: E731
        tmux.wait_for(prompts(1), "the first prompt")
        tmux.keys("The capital of Frnce is", "Left", "Left", "Left", "Left", "Left", "Left")
        tmux.keys("a", "Enter")  # line editing: the missing letter put back
        tmux.wait_for(prompts(2), "the first answer")
        tmux.keys("Up", "Enter")  # history: the same question again
        tmux.wait_for(prompts(3), "the second answer")
        tmux.keys(f"/save {saved}", "Enter")
        tmux.wait_for(lambda s: "(saved 4 messages" in s, "the save")
        tmux.keys("/clear", "Enter")
        tmux.wait_for(lambda s: "(conversation cleared)" in s, "the clear")
        tmux.keys("C-d")
        screen = tmux.wait_for(lambda s: "EXIT=" in s, "the exit")
    finally:
        tmux.close()
    assert "EXIT=0" in screen
    messages = json.loads(saved.read_text())
    question = "The capital of France is"
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[1]["content"] == messages[3]["content"] == question
    from helpers import CPU

    from spnl_backend import load_backend

    with load_backend(str(model), settings=CPU) as backend:
        first = backend.chat(messages[:2], max_tokens=6, temperature=0).text
        second = backend.chat(messages[:4], max_tokens=6, temperature=0).text
    assert [messages[2]["content"], messages[4]["content"]] == [first, second]
    assert f"{question}\n{first}" in screen.replace(">>> ", "")


def test_ctrl_c_stops_an_answer_and_keeps_its_start(tiny, tmp_path):
    model = _model_with_template(tiny, tmp_path)
    saved = tmp_path / "conversation.json"
    tmux = _chat(model, tmp_path, "--temperature 0 --max-tokens 0")
    try:
        tmux.wait_for(lambda s: ">>>" in s, "the prompt")
        tmux.keys("Once upon a time", "Enter")
        tmux.wait_for(
            lambda s: "Once upon a time\n" in s and not s.rstrip().endswith("time"),
            "the answer to start",
        )
        tmux.keys("C-c")
        tmux.wait_for(lambda s: s.count(">>>") >= 2, "the prompt after Ctrl-C")
        tmux.keys(f"/save {saved}", "Enter")
        tmux.wait_for(lambda s: "(saved" in s, "the save")
        tmux.keys("C-c")  # at the prompt: nothing but a fresh line
        tmux.keys("/bye", "Enter")
        screen = tmux.wait_for(lambda s: "EXIT=" in s, "the exit")
    finally:
        tmux.close()
    assert "EXIT=0" in screen
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["user", "assistant"]
    # Greedy, this model writes until the context is full (488 tokens): still running.
    assert "[answer stopped]" in screen, screen
    assert messages[1]["content"]


def test_conversation_messages_and_save(tmp_path):
    conversation = Conversation("sys", [{"role": "user", "content": "hi"}])
    conversation.save(tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text())[0] == {"role": "system", "content": "sys"}
