"""The reasoning's controls in the engine: a budget that closes the reasoning with the
format's own markers, and a constraint that holds the answer alone (lazy over the
reasoning); exact, batch-invariant and the same with speculation. On a tiny model whose
vocabulary has ``<think>``, ``</think>`` and the harmony tags as tokens, with real chat
templates (``data/templates``)."""

import json
from pathlib import Path

import pytest
import torch
from helpers import CPU, NO_SPECULATION, run_together, scripted_logits
from live_server import MODEL
from tiny_models import build_hf_model

from spnl_backend import load_backend
from spnl_backend.engine.speculative import SpeculativeRunner
from spnl_backend.engine.token_bitmask import new_bitmask, unpack
from spnl_backend.errors import RequestError, SettingsError
from spnl_backend.reasoning import HARMONY_TAGS
from spnl_backend.reasoning.gate import GateTokens, ReasoningGate
from spnl_backend.settings import BackendSettings

TEMPLATES = Path(__file__).parent / "data" / "templates"
GPT_OSS = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
R1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
ASK = [{"role": "user", "content": "what is 2+2?"}]
THINKING = {"enable_thinking": True}  # R1's generation prompt then ends inside <think>


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("think") / "llama"
    return build_hf_model("llama", path, specials=("<think>", "</think>", *HARMONY_TAGS)).path


@pytest.fixture(scope="module")
def backend(think_model):
    """Without speculation: `helpers.scripted_logits` biases one token a step, which a
    verifying step of several rows would misread (speculation's budgets are tested below
    against this backend)."""
    backend = load_backend(str(think_model), settings=NO_SPECULATION)
    backend.tokenizer.hf.chat_template = R1
    yield backend
    backend.close()


def _ids(backend, text: str) -> list[int]:
    return backend.tokenizer.encode_plain(text)


def _chat(backend, **kw):
    kw = {"max_tokens": 24, "temperature": 0, "chat_template_kwargs": THINKING, **kw}
    return backend.chat(ASK, **kw)


def _free(backend, tokens: int = 24) -> list[int]:
    """The unbounded greedy output, checked to stay in the reasoning that long."""
    ids = _chat(backend, max_tokens=tokens).token_ids
    assert _ids(backend, "</think>")[0] not in ids  # the model never closes it itself
    return ids


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_a_budget_closes_the_reasoning_with_the_markers_then_answers(backend, budget):
    free = _free(backend)
    result = _chat(backend, thinking_token_budget=budget)
    closing = _ids(backend, "</think>\n\n")
    assert result.token_ids[:budget] == free[:budget]  # the reasoning is the model's own
    assert result.token_ids[budget : budget + len(closing)] == closing
    assert len(result.token_ids) == 24  # max_tokens counts the whole output
    assert result.reasoning == backend.tokenizer.decode(free[:budget]).strip()
    answer = backend.tokenizer.decode(result.token_ids[budget + len(closing) :])
    assert result.text == answer.lstrip()


def test_a_budget_leaves_the_other_sequences_of_the_batch_alone(backend):
    free = _free(backend)
    sampled = _chat(backend, temperature=0.8, seed=7).token_ids
    bounded, plain, seeded = run_together(
        backend,
        lambda: _chat(backend, thinking_token_budget=2),
        lambda: _chat(backend),
        lambda: _chat(backend, temperature=0.8, seed=7),
    )
    assert plain.token_ids == free
    assert seeded.token_ids == sampled
    assert bounded.token_ids[2] == _ids(backend, "</think>")[0]


def test_a_sampled_budget_is_kept_exactly(backend):
    closing = _ids(backend, "</think>\n\n")
    for seed in range(3):
        ids = _chat(backend, temperature=1.0, seed=seed, thinking_token_budget=3).token_ids
        free = _chat(backend, temperature=1.0, seed=seed, max_tokens=3).token_ids
        if closing[0] in free:
            continue  # the model closed it first: nothing forced
        assert ids[:3] == free
        assert ids[3 : 3 + len(closing)] == closing


def test_a_stop_string_in_the_answer_ends_a_budgeted_output(backend):
    whole = _chat(backend, thinking_token_budget=2)
    stop = whole.text[2:5]
    assert stop
    assert stop not in whole.reasoning
    stopped = _chat(backend, thinking_token_budget=2, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.reasoning == whole.reasoning
    assert stopped.text == whole.text[: whole.text.index(stop)]


def test_a_constraint_holds_the_answer_after_the_reasoning(backend):
    free = _free(backend)
    result = _chat(backend, thinking_token_budget=4, regex=r"It is 4\.", logprobs=True)
    assert result.token_ids[:4] == free[:4]  # the grammar was not applied to the reasoning
    assert result.text == "It is 4."
    assert result.reasoning == backend.tokenizer.decode(free[:4]).strip()
    assert result.finish_reason == "stop"
    assert len(result.logprobs) == len(result.token_ids)
    closing = len(_ids(backend, "</think>\n\n"))
    forced = result.logprobs[4 : 4 + closing]
    assert all(entry.logprob == 0.0 for entry in forced)  # the only token allowed


def test_a_constraint_starts_where_the_model_closes_its_reasoning(backend):
    close = _ids(backend, "</think>")[0]
    result = _chat(
        backend,
        regex=r"It is 4\.",
        logit_bias={close: 30.0},  # the model closes at once, of its own choice
    )
    assert result.token_ids[0] == close
    assert result.token_ids[1 : 1 + len(_ids(backend, "\n\n"))] == _ids(backend, "\n\n")
    assert (result.reasoning, result.text) == ("", "It is 4.")


@pytest.mark.slow
def test_the_budget_is_the_same_with_speculation(think_model, backend):
    speculative = load_backend(
        str(think_model),
        settings=BackendSettings(device="cpu", speculative_draft_model=str(think_model)),
    )
    speculative.tokenizer.hf.chat_template = R1
    try:
        for kw in (
            {"thinking_token_budget": 3},
            {"thinking_token_budget": 2, "regex": r"It is 4\."},
        ):
            want, got = _chat(backend, **kw), _chat(speculative, **kw)
            assert (got.token_ids, got.text, got.reasoning) == (
                want.token_ids,
                want.text,
                want.reasoning,
            )
        # Sampled, speculation draws other tokens (the same distribution): the forced
        # sequence still comes right after the budget, each token once.
        closing = _ids(backend, "</think>\n\n")
        ids = _chat(speculative, thinking_token_budget=3, temperature=0.9, seed=1).token_ids
        assert ids[3 : 3 + len(closing)] == closing
        assert closing[0] not in ids[:3]
        assert isinstance(speculative._loop.engine.runner, SpeculativeRunner)
    finally:
        speculative.close()
    ngram = load_backend(
        str(think_model), settings=BackendSettings(device="cpu", speculative_method="ngram")
    )
    ngram.tokenizer.hf.chat_template = R1
    try:
        for kw in (
            {"thinking_token_budget": 3},
            {"thinking_token_budget": 2, "regex": r"It is 4\."},
        ):
            want, got = _chat(backend, max_tokens=40, **kw), _chat(ngram, max_tokens=40, **kw)
            assert (got.token_ids, got.text) == (want.token_ids, want.text)
    finally:
        ngram.close()


def test_a_spanning_constraint_follows_the_reasoning_and_the_budget_only_ends_it():
    # gpt-oss's tool-call grammar holds the analysis message too: it sees every token,
    # and a spent budget ends the analysis, the grammar choosing the next header.
    answer = RecordAll()
    gate = _gate(HARMONY, budget=1, answer=answer, spanning=True)
    for token in (CHANNEL, ANALYSIS, MESSAGE, 30):
        assert _allowed(gate) == {-1}  # the grammar's mask (here: anything)
        gate.accept(token)
    for token in HARMONY.reopen:  # the budget: the analysis ends, the header reopens
        assert _allowed(gate) == {token}
        gate.accept(token)
    for token in (CHANNEL, FINAL, MESSAGE, TEXT):
        assert _allowed(gate) == {-1}
        gate.accept(token)
    reopened = [*HARMONY.reopen, CHANNEL, FINAL, MESSAGE, TEXT]
    assert answer.accepted == [CHANNEL, ANALYSIS, MESSAGE, 30, *reopened]
    assert gate.phase == "answer"


class RecordAll:
    """A constraint that allows every token and records each it accepted."""

    active = True

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def fork(self) -> "RecordAll":
        twin = RecordAll()
        twin.accepted = list(self.accepted)
        return twin


def test_a_budget_is_refused_where_the_markers_are_not_tokens(tiny):
    plain = load_backend(str(tiny.hf("llama").path), settings=CPU)
    plain.tokenizer.hf.chat_template = R1
    try:
        with pytest.raises(RequestError, match="not single tokens"):
            _chat(plain, thinking_token_budget=3)
        with pytest.raises(RequestError, match="thinking_token_budget=-1"):
            _chat(plain, thinking_token_budget=-1)
    finally:
        plain.close()


# ---- the gate alone, token by token -------------------------------------------------------

OPEN, CLOSE, SEP, TEXT = 5, 6, 7, 9
THINK = GateTokens("think", CLOSE, (CLOSE, SEP), (SEP,), open=OPEN)
CHANNEL, MESSAGE, END, START, ASSISTANT, FINAL, ANALYSIS = 10, 11, 12, 13, 14, 15, 16
HARMONY = GateTokens(
    "harmony",
    MESSAGE,
    (END, START, ASSISTANT, CHANNEL, FINAL, MESSAGE),
    channel=CHANNEL,
    end=END,
    reopen=(END, START, ASSISTANT),
)
NAMES = {FINAL: "final", ANALYSIS: "analysis", TEXT: "x"}


class OnlyText:
    """An answer constraint that allows TEXT alone, recording what it accepted."""

    active = True

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, 0] = 1 << TEXT

    def accept(self, token_id: int) -> None:
        assert token_id == TEXT
        self.accepted.append(token_id)

    def fork(self) -> "OnlyText":
        twin = OnlyText()
        twin.accepted = list(self.accepted)
        return twin


def _allowed(gate: ReasoningGate) -> set[int]:
    bitmask = new_bitmask(1, 64)
    gate.fill(bitmask, 0)
    allowed = unpack(bitmask, 64)[0]
    return set(torch.nonzero(allowed).flatten().tolist()) if not allowed.all() else {-1}


def _gate(tokens=THINK, budget=None, answer=None, inside=False, spanning=False) -> ReasoningGate:
    decode = lambda ids: "".join(NAMES.get(i, "?") for i in ids)  # noqa: E731
    return ReasoningGate(tokens, budget, answer, inside, decode, spanning)


def test_the_gate_lets_the_model_open_its_reasoning_or_answer_at_once():
    answer = OnlyText()
    gate = _gate(answer=answer)
    assert _allowed(gate) == {TEXT, OPEN}  # the constraint's tokens, or <think>
    gate.accept(OPEN)
    assert _allowed(gate) == {-1}
    assert answer.accepted == []
    gate.accept(20)
    gate.accept(CLOSE)
    assert _allowed(gate) == {SEP}
    gate.accept(SEP)
    assert _allowed(gate) == {TEXT}
    gate.accept(TEXT)
    assert answer.accepted == [TEXT]
    direct = _gate(answer=OnlyText())
    direct.accept(TEXT)  # no reasoning: the answer from the first token
    assert direct.phase == "answer"
    assert direct.answer.accepted == [TEXT]


def test_the_gate_forces_the_close_at_the_budget_and_forks_apart():
    gate = _gate(budget=2, inside=True)
    gate.accept(20)
    fork = gate.fork()
    fork.accept(21)
    assert _allowed(fork) == {CLOSE}
    assert _allowed(gate) == {-1}
    for token in (CLOSE, SEP):
        fork.accept(token)
    assert not fork.active  # no answer constraint: nothing left to hold
    with pytest.raises(Exception, match="closing sequence expected token 6"):
        _gate(budget=0, inside=True).accept(20)


def test_the_harmony_gate_counts_analysis_and_starts_the_answer_at_final():
    gate = _gate(HARMONY, budget=2, answer=OnlyText())
    for token in (CHANNEL, ANALYSIS, MESSAGE, 30):
        gate.accept(token)
        assert _allowed(gate) == {-1}
    gate.accept(31)  # the budget: the final message's header is forced
    for token in HARMONY.forced:
        assert _allowed(gate) == {token}
        gate.accept(token)
    assert _allowed(gate) == {TEXT}
    natural = _gate(HARMONY, budget=5, answer=OnlyText())
    for token in (CHANNEL, ANALYSIS, MESSAGE, 30, END, START, ASSISTANT, CHANNEL, FINAL):
        natural.accept(token)
    assert _allowed(natural) == {-1}
    natural.accept(MESSAGE)
    assert _allowed(natural) == {TEXT}
    assert natural.used == 1


# ---- through the server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(backend):
    from live_server import LiveServer

    server = LiveServer(backend)
    yield server
    server.stop()


def _post(live, path: str, **body):
    reply = live.post(path, {"model": MODEL, "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_token_budget_on_chat_completions(live, backend, stream):
    want = _chat(backend, thinking_token_budget=3, max_tokens=12)
    body = dict(messages=ASK, max_tokens=12, chat_template_kwargs=THINKING, stream=stream)
    reply = _post(live, "/v1/chat/completions", thinking_token_budget=3, **body)
    if stream:
        chunks = [json.loads(x[6:]) for x in reply.text.splitlines() if x[6:7] == "{"]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
    else:
        message = reply.json()["choices"][0]["message"]
        reasoning, content = message["reasoning_content"], message["content"]
    assert (reasoning, content) == (want.reasoning, want.text)
    assert reasoning == backend.tokenizer.decode(_free(backend)[:3]).strip()


def test_anthropic_budget_tokens_bound_the_thinking(live, backend):
    want = _chat(backend, thinking_token_budget=4, max_tokens=12)
    reply = _post(
        live,
        "/v1/messages",
        messages=ASK,
        max_tokens=12,
        thinking={"type": "enabled", "budget_tokens": 4},
    )
    blocks = reply.json()["content"]
    assert blocks[0] == {"type": "thinking", "thinking": want.reasoning, "signature": ""}
    assert reply.json()["usage"]["output_tokens"] == 12  # thinking and answer together


@pytest.mark.parametrize("budget", [-1, 1.5, True, "3"])
def test_a_bad_budget_is_a_400_naming_it(live, budget):
    reply = live.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": ASK, "thinking_token_budget": budget},
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "thinking_token_budget"
    assert "expected an integer >= 0" in reply.json()["error"]["message"]


# ---- the chat template: server-wide variables, a request's own template --------------------

GREETING = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_default_template_kwargs_are_merged_under_the_requests(backend, monkeypatch):
    defaults = BackendSettings(device="cpu", default_chat_template_kwargs='{"greeting": "hi "}')
    monkeypatch.setattr(backend, "settings", defaults)
    plain = backend.chat_prompt_ids(ASK, None, None, GREETING)
    assert plain == _ids(backend, "hi what is 2+2?")
    own = backend.chat_prompt_ids(ASK, None, {"greeting": "yo "}, GREETING)
    assert own == _ids(backend, "yo what is 2+2?")


@pytest.mark.parametrize("value", ["[1]", "{", '{"messages": []}'])
def test_bad_default_template_kwargs_are_refused_naming_the_variable(value):
    with pytest.raises(SettingsError, match="MISTRALRS_DEFAULT_CHAT_TEMPLATE_KWARGS"):
        BackendSettings(default_chat_template_kwargs=value)


def test_the_serve_flag_reaches_the_settings(monkeypatch):
    from spnl_backend import cli
    from spnl_backend.server import run

    seen = {}
    monkeypatch.setattr(run, "serve", lambda **kw: seen.update(kw) or 0)
    cli.main(["serve", "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert seen["default_chat_template_kwargs"] == '{"enable_thinking": false}'


def test_a_requests_chat_template_is_used_and_a_bad_one_refused(live, backend):
    body = dict(
        messages=ASK,
        max_tokens=1,
        chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}",
    )
    reply = _post(live, "/v1/chat/completions", **body)
    assert reply.json()["usage"]["prompt_tokens"] == len(_ids(backend, "[what is 2+2?]"))
    for bad, words in (("{% for %}", "does not compile (line 1)"), (5, "expected a Jinja")):
        refused = live.post("/v1/chat/completions", {**body, "model": MODEL, "chat_template": bad})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "chat_template"
        assert words in refused.json()["error"]["message"]


def test_a_requests_template_decides_the_reasoning_format(live, backend):
    # The model's template (R1's) writes <think> blocks; a plain one writes none, so
    # the whole output is the answer.
    body = dict(messages=ASK, max_tokens=6, chat_template=GREETING, thinking_token_budget=2)
    message = _post(live, "/v1/chat/completions", **body).json()["choices"][0]["message"]
    assert "reasoning_content" not in message


# ---- harmony through the engine: the model's first choices scripted -------------------------


@pytest.fixture
def scripted(backend, monkeypatch):
    monkeypatch.setattr(backend.tokenizer.hf, "chat_template", GPT_OSS)
    return scripted_logits(backend, monkeypatch)


def test_a_harmony_budget_closes_the_analysis_and_opens_the_final_message(backend, scripted):
    header = _ids(backend, "<|channel|>analysis<|message|>")
    thought = _ids(backend, "I add")[:3]
    scripted += [*header, *thought, *_ids(backend, "more thought")]
    result = _chat(backend, thinking_token_budget=len(thought), max_tokens=30)
    forced = _ids(backend, "<|end|><|start|>assistant<|channel|>final<|message|>")
    ids = result.token_ids
    assert ids[: len(header) + len(thought)] == header + thought
    closed = len(header) + len(thought)
    assert ids[closed : closed + len(forced)] == forced
    assert result.reasoning == backend.tokenizer.decode(thought)
    assert result.text == backend.tokenizer.decode(ids[closed + len(forced) :])


def test_a_harmony_constraint_starts_at_the_final_message(backend, scripted):
    header = _ids(backend, "<|channel|>analysis<|message|>")
    final = _ids(backend, "<|end|><|start|>assistant<|channel|>final<|message|>")
    scripted += [*header, *_ids(backend, "hm"), *final]
    result = _chat(backend, regex=r"Four\.", max_tokens=40)
    assert (result.reasoning, result.text) == ("hm", "Four.")
