"""Reasoning through the server: a tiny model given real chat templates (Qwen3's,
DeepSeek-R1's, gpt-oss's, in ``data/templates``), its output forced by a regex where the
test needs one; OpenAI's ``reasoning_content``/``reasoning`` whole and streamed, Ollama's
``think`` and ``thinking``, the template variables, and the user's chat template."""

import asyncio
import json
import random
from pathlib import Path
from types import SimpleNamespace

import httpx
import ollama
import pytest
from helpers import CPU
from live_server import MODEL, TEMPLATE, served_backend
from tiny_models import build_tokenizer

from spnl_backend import load_backend
from spnl_backend.errors import RequestError, SettingsError
from spnl_backend.loader.tokenizer import Tokenizer, VocabTokenizer
from spnl_backend.reasoning import HARMONY_TAGS, Reasoning
from spnl_backend.server.responses import Reply
from spnl_backend.settings import BackendSettings
from spnl_backend.tools.formats import HERMES

TEMPLATES = Path(__file__).parent / "data" / "templates"
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
R1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
GPT_OSS = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
ASK = [{"role": "user", "content": "what is 2+2?"}]
THOUGHT_REGEX = r"<think>\nI add two and two\.\n</think>\n\nIt is 4\."


@pytest.fixture(scope="module")
def backend(tiny):
    backend = served_backend(tiny)
    yield backend
    backend.close()


@pytest.fixture
def template(backend):
    """Set the served model's chat template for one test."""
    before = backend.tokenizer.hf.chat_template

    def use(source: str) -> None:
        backend.tokenizer.hf.chat_template = source

    yield use
    backend.tokenizer.hf.chat_template = before


def _chat(live, stream: bool = False, **body) -> dict | list[dict]:
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "stream": stream, **body}
    reply = live.post("/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    if not stream:
        return reply.json()
    lines = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def _joined(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


# ---- OpenAI's chat completions -----------------------------------------------------------


def test_qwen3_reasoning_is_split_whole_and_streamed(live, template):
    template(QWEN3)
    whole = _chat(live, guided_regex=THOUGHT_REGEX, max_tokens=200)
    message = whole["choices"][0]["message"]
    assert message["content"] == "It is 4."
    assert message["reasoning_content"] == message["reasoning"] == "I add two and two."
    chunks = _chat(live, stream=True, guided_regex=THOUGHT_REGEX, max_tokens=200)
    assert _joined(chunks, "content") == "It is 4."
    assert _joined(chunks, "reasoning_content") == _joined(chunks, "reasoning")
    assert _joined(chunks, "reasoning_content") == "I add two and two."
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_openai_client_reads_both_names(live, template):
    template(QWEN3)
    reply = live.client().chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_tokens=200,
        extra_body={"guided_regex": THOUGHT_REGEX, "chat_template_kwargs": {"any_var": 1}},
    )
    message = reply.choices[0].message
    assert (message.content, message.reasoning_content) == ("It is 4.", "I add two and two.")


def test_a_model_without_reasoning_keeps_its_message_as_it_was(live, template):
    template(TEMPLATE)
    message = _chat(live, max_tokens=5)["choices"][0]["message"]
    assert set(message) == {"role", "content"}


def test_enable_thinking_reaches_the_template(live, backend, template):
    template(QWEN3)
    on = _chat(live, max_tokens=1)["usage"]["prompt_tokens"]
    off = _chat(live, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    closed = backend.tokenizer.encode_plain("<think>\n\n</think>\n\n")
    assert off["usage"]["prompt_tokens"] == on + len(closed)


def _greedy_after(backend, variables: dict | None, max_tokens: int) -> str:
    ids = backend.chat_prompt_ids(ASK, None, variables)
    return backend.generate(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0).text


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_opens_the_block_starts_the_output_inside_it(live, backend, template, stream):
    # DeepSeek-R1's generation prompt ends with "<think>\n", closed again unless
    # enable_thinking: the output is all reasoning until the model writes </think>.
    template(R1)
    thinking = {"enable_thinking": True}
    text = _greedy_after(backend, thinking, 12)
    asked = dict(max_tokens=12, chat_template_kwargs=thinking)
    if stream:
        chunks = _chat(live, stream=True, **asked)
        got = (_joined(chunks, "reasoning_content"), _joined(chunks, "content"))
    else:
        message = _chat(live, **asked)["choices"][0]["message"]
        got = (message["reasoning_content"], message["content"])
    assert "</think>" not in text
    assert got == (text.lstrip(), "")  # cut short inside: its end kept as it is
    closed = _chat(live, max_tokens=12)["choices"][0]["message"]
    assert closed["content"] == _greedy_after(backend, None, 12)
    assert closed["reasoning_content"] is None


def test_harmony_channels_are_split_and_effort_reaches_the_system_message(live, backend, template):
    template(GPT_OSS)
    prompt = backend.tokenizer.render_chat(ASK, True, None, {"reasoning_effort": "high"})
    assert "Reasoning: high" in prompt
    assert prompt.endswith("<|start|>assistant")
    forced = (
        r"<\|channel\|>analysis<\|message\|>Two and two\.<\|end\|>"
        r"<\|start\|>assistant<\|channel\|>final<\|message\|>Four\."
    )
    whole = _chat(live, guided_regex=forced, max_tokens=300, reasoning_effort="low")
    message = whole["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("Two and two.", "Four.")
    chunks = _chat(live, stream=True, guided_regex=forced, max_tokens=300)
    assert (_joined(chunks, "reasoning"), _joined(chunks, "content")) == ("Two and two.", "Four.")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"reasoning_effort": "max"}, "reasoning_effort", "expected 'low', 'medium' or 'high'"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "expected an object"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "own input"),
        (
            {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
            "reasoning_effort",
            "disagree",
        ),
        (
            {"messages": [{"role": "assistant", "content": "x", "reasoning": 5}]},
            "messages",
            "one string",
        ),
    ],
)
def test_bad_reasoning_fields_are_400_naming_them(live, extra, param, words):
    reply = live.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, **extra})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param
    assert words in error["message"]


def test_reasoning_effort_is_refused_on_completions(live):
    body = {"model": MODEL, "prompt": "hi", "reasoning_effort": "low"}
    reply = live.post("/v1/completions", body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "reasoning_effort"


def test_a_past_turns_reasoning_reaches_the_template(backend, template):
    template("{% for m in messages %}[{{ m.reasoning_content }}]{{ m.content }}{% endfor %}")
    from spnl_backend.server.protocol import parse_chat

    turns = [*ASK, {"role": "assistant", "content": "4", "reasoning": "add"}, *ASK]
    asked = parse_chat({"model": MODEL, "messages": turns})
    text = backend.tokenizer.render_chat(asked.messages, False)
    assert "[add]4" in text


# ---- tool calls read from the answer alone ------------------------------------------------


def _fake_seq(text: str) -> SimpleNamespace:
    params = SimpleNamespace(logprobs=False)
    return SimpleNamespace(seq_id=7, text=text, finish_reason="stop", params=params, logprobs=[])


def test_tool_calls_are_read_after_the_reasoning_whole_and_streamed():
    text = (
        "<think>\nThe user wants <tool_call> help.\n</think>\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": true}}\n</tool_call>'
    )
    seq = _fake_seq(text)
    reply = Reply("chat", MODEL, [seq], 1, tools=HERMES, reasoning=Reasoning("think"))
    whole = reply._choice(seq)
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["reasoning_content"] == "The user wants <tool_call> help."
    (call,) = whole["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "add",
        {"a": 1, "b": True},
    )
    rng = random.Random(5)
    for _ in range(10):
        streamed = Reply("chat", MODEL, [seq], 1, tools=HERMES, reasoning=Reasoning("think"))
        cuts = sorted(rng.sample(range(1, len(text)), 8))
        chunks = [
            streamed.text_chunk(seq, text[a:b])
            for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)
        ]
        chunks = [c for c in chunks if c is not None] + [streamed.end_chunk(seq)]
        assert _joined(chunks, "reasoning_content") == "The user wants <tool_call> help."
        assert _joined(chunks, "content") == ""
        arguments = "".join(
            entry["function"]["arguments"]
            for c in chunks
            for entry in c["choices"][0]["delta"].get("tool_calls", [])
        )
        assert json.loads(arguments) == {"a": 1, "b": True}
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---- Ollama -------------------------------------------------------------------------------


def test_ollama_think_shows_the_thinking_streamed_and_not(live, backend, template):
    template(R1)
    client = ollama.Client(host=live.url)
    options = {"temperature": 0, "num_predict": 10}
    text = _greedy_after(backend, {"enable_thinking": True}, 10)
    whole = client.chat(model=MODEL, messages=ASK, think=True, options=options)
    assert (whole.message.thinking, whole.message.content) == (text.lstrip(), "")
    parts = list(client.chat(model=MODEL, messages=ASK, think=True, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == text.lstrip()
    assert "thinking" in client.show(MODEL).capabilities
    unthought = client.chat(model=MODEL, messages=ASK, think=False, options=options)
    assert unthought.message.thinking is None
    assert unthought.message.content == _greedy_after(backend, {"enable_thinking": False}, 10)


def test_ollama_think_levels_and_refusals(live, template):
    template(TEMPLATE)
    body = {"model": MODEL, "messages": ASK, "think": True, "stream": False}
    refused = live.post("/api/chat", body)
    assert refused.status_code == 400
    assert "writes no reasoning" in refused.json()["error"]
    assert "thinking" not in ollama.Client(host=live.url).show(MODEL).capabilities
    template(GPT_OSS)
    level = live.post("/api/chat", {**body, "think": "high", "options": {"num_predict": 2}})
    assert level.status_code == 200, level.text
    bad = live.post("/api/chat", {**body, "think": "max"})
    assert bad.status_code == 400
    assert "think='max'" in bad.json()["error"]


# ---- the markers kept in the text, the user's template ------------------------------------


@pytest.mark.parametrize("gguf", [False, True])
def test_harmony_markers_that_are_special_tokens_are_kept_in_the_text(gguf):
    hf = build_tokenizer(specials=HARMONY_TAGS)
    # A GGUF file's vocabulary is read by the tokenizers library alone (`VocabTokenizer`).
    wrapped = VocabTokenizer(hf.backend_tokenizer, {"eos_token": "<eos>"}, None) if gguf else hf
    tokenizer = Tokenizer(wrapped, [1])
    ids = hf("<|channel|>final<|message|>Hi", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "finalHi"  # what plain decoding shows
    kept = frozenset(hf.convert_tokens_to_ids(list(HARMONY_TAGS)))
    assert tokenizer.decode_keeping(ids, kept) == "<|channel|>final<|message|>Hi"


def test_a_chosen_chat_template_is_used_and_a_bad_one_refused_with_its_line(tiny, tmp_path):
    path = tiny.hf("llama").path
    chosen = tmp_path / "chosen.jinja"
    chosen.write_text(QWEN3)
    settings = BackendSettings(**{**CPU.model_dump(), "chat_template": str(chosen)})
    with load_backend(str(path), settings=settings) as backend:
        assert backend.tokenizer.hf.chat_template == QWEN3
        assert backend.reasoning(backend.chat_prompt_ids(ASK)).format == "think"
    inline = BackendSettings(**{**CPU.model_dump(), "chat_template": "{{ messages[0].content }}"})
    with load_backend(str(path), settings=inline) as backend:
        assert backend.tokenizer.render_chat(ASK, True) == ASK[0]["content"]
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    settings = BackendSettings(**{**CPU.model_dump(), "chat_template": str(bad)})
    with pytest.raises(
        SettingsError, match=r"bad\.jinja: the chat template does not compile \(line 2\)"
    ):
        load_backend(str(path), settings=settings)
    with pytest.raises(SettingsError, match="neither Jinja source"):
        load_backend(str(path), settings=BackendSettings(device="cpu", chat_template="nope.j2"))


def test_the_reasoning_format_setting_overrides_the_template(backend, template, monkeypatch):
    template(QWEN3)
    ids = backend.chat_prompt_ids(ASK)
    assert backend.reasoning(ids).format == "think"
    monkeypatch.setattr(backend, "settings", BackendSettings(device="cpu", reasoning_format="none"))
    assert backend.reasoning(ids).format == "none"
    with pytest.raises(SettingsError, match="MISTRALRS_REASONING_FORMAT"):
        BackendSettings(reasoning_format="sometimes")


def test_think_and_raw_do_not_mix(live):
    body = {"model": MODEL, "prompt": "hi", "raw": True, "think": True, "stream": False}
    reply = httpx.post(live.url + "/api/generate", json=body, timeout=60)
    assert reply.status_code == 400
    assert "raw" in reply.json()["error"]


def test_the_python_api_returns_the_reasoning_apart(backend, template):
    template(R1)
    thinking = {"enable_thinking": True}
    text = _greedy_after(backend, thinking, 10)
    result = backend.chat(ASK, max_tokens=10, temperature=0, chat_template_kwargs=thinking)
    assert (result.reasoning, result.text) == (text.lstrip(), "")
    closed = backend.chat(ASK, max_tokens=10, temperature=0)
    assert (closed.reasoning, closed.text) == ("", _greedy_after(backend, None, 10))
    template(TEMPLATE)
    assert backend.chat(ASK, max_tokens=3, temperature=0).reasoning is None
    with pytest.raises(RequestError, match="reasoning_effort='max'"):
        backend.chat(ASK, max_tokens=3, reasoning_effort="max")


def test_achat_takes_the_template_variables_too(backend, template):
    template(R1)
    thinking = {"enable_thinking": True}
    asked = backend.achat(ASK, max_tokens=10, temperature=0, chat_template_kwargs=thinking)
    result = asyncio.run(asked)
    assert result.reasoning == _greedy_after(backend, thinking, 10).lstrip()
