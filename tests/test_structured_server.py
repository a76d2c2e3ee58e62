"""Structured output, log-probabilities, penalties and token healing through the HTTP
server: OpenAI's shapes, vLLM's extension names, and the same tokens as the Python API."""

import json

import httpx
import jsonschema
import pytest
from live_server import MODEL, served_backend
from test_structured import CHOICES, SCHEMAS

from spnl_backend.request import sampling_params
from spnl_backend.results import read_results

CHAT = [{"role": "user", "content": "describe a person"}]


@pytest.fixture(scope="module")
def backend(tiny):
    backend = served_backend(tiny)
    yield backend
    backend.close()


def test_chat_json_schema_response_format_equals_the_python_api(live, backend):
    schema = SCHEMAS[0]
    reply = live.client().chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=160,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
    )
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert reply.choices[0].finish_reason == "stop"
    expected = backend.chat(CHAT, max_tokens=160, temperature=0, json_schema=schema)
    assert text == expected.text


def test_json_object_and_vllm_guided_names(live, backend):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "temperature": 0}
    for field, value, check in [
        ("guided_choice", CHOICES, lambda t: t in CHOICES),
        ("guided_regex", "[0-9]{2}-[a-z]{2}", lambda t: len(t) == 5 and t[2] == "-"),
        ("guided_grammar", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
        (
            "guided_json",
            SCHEMAS[1],
            lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1]) or True,
        ),
    ]:
        reply = live.post("/v1/completions", {**body, field: value}).json()
        assert check(reply["choices"][0]["text"]), (field, reply)
    bad = live.post("/v1/completions", {**body, "guided_json": SCHEMAS[1], "guided_regex": "a"})
    assert bad.status_code == 400
    assert "at most one of" in bad.json()["error"]["message"]


def test_chat_logprobs_in_openais_shape_each_completion_its_own(live, backend):
    reply = live.client().chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        n=2,
        logprobs=True,
        top_logprobs=4,
    )
    params = sampling_params(max_tokens=6, temperature=1.0, seed=3, logprobs=True, top_logprobs=4)
    request = backend.submit([backend.chat_prompt_ids(CHAT)], params, n=2)
    results = read_results(request, single=False)
    for choice, result in zip(reply.choices, results, strict=True):
        content = choice.logprobs.content
        assert [c.logprob for c in content] == pytest.approx(
            [e.logprob for e in result.logprobs], abs=1e-6
        )
        tokens = backend.token_bytes(result.token_ids)
        assert [bytes(c.bytes) for c in content] == tokens
        for entry in content:
            assert 1 <= len(entry.top_logprobs) <= 4
            values = [t.logprob for t in entry.top_logprobs]
            assert values == sorted(values, reverse=True)


def test_completion_logprobs_and_streamed_logprobs(live):
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    whole = live.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    assert set(whole) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(whole["tokens"]) == len(whole["token_logprobs"]) == 5
    assert all(len(top) <= 2 for top in whole["top_logprobs"])
    assert whole["text_offset"] == sorted(whole["text_offset"])
    streamed: list[float] = []
    with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                logprobs = chunk["choices"][0]["logprobs"]
                streamed += logprobs["token_logprobs"] if logprobs else []
    assert streamed == pytest.approx(whole["token_logprobs"], abs=1e-6)


def test_penalties_and_token_healing_through_the_server(live, backend):
    body = {"model": MODEL, "prompt": "the cat sat on the m", "max_tokens": 8, "temperature": 0}
    extra = {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.4,
        "min_p": 0.05,
        "logit_bias": {"40": 3},
        "token_healing": True,
    }
    reply = live.post("/v1/completions", {**body, **extra}).json()
    expected = backend.generate(
        body["prompt"], max_tokens=8, temperature=0, **{**extra, "logit_bias": {40: 3}}
    )
    assert reply["choices"][0]["text"] == expected.text
    assert reply["usage"]["prompt_tokens"] == expected.usage.prompt_tokens


def test_a_grammar_that_fails_mid_way_is_a_400_and_bad_constraints_name_their_field(live):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "temperature": 0}
    endless = live.post("/v1/completions", {**body, "guided_grammar": 'start: a\na: "x" a'})
    assert endless.status_code == 400
    assert "<state>" not in endless.json()["error"]["message"]  # llguidance's dump left out
    for field, value in [
        ("guided_json", '{"type": "number", "minimum": 1e400}'),
        ("guided_regex", "(unclosed"),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
    ]:
        reply = live.post("/v1/completions", {**body, field: value})
        assert reply.status_code == 400, (field, reply.text)
        assert reply.json()["error"]["param"] == field
