"""spnl's ``spnl/`` provider against the server: ``POST /v1/query/execute`` spoken exactly
as spnl 0.22.1's client speaks it (`bench.spnl_client`), streamed and not, ``repeat`` and
``map``, documents reused in any order, errors as 4xx, and ``/reset_prefix_cache``."""

import json
import random

import httpx
import pytest
from helpers import CPU
from live_server import MODEL, TEMPLATE, LiveServer

from bench.spnl_client import check_completion, execute_openai, execute_spnl, query_json
from spnl_backend import load_backend

DOCS = [
    "Once upon a time there was a little model that cached blocks.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Tokens, tokens everywhere; caches and blocks and prefixes.",
    "def add(a, b): return a + b, said the function to the caller.",
]
SYSTEM = "Answer from the documents."


@pytest.fixture(scope="module")
def backend(tiny):
    backend = load_backend(str(tiny.hf("llama").path), settings=CPU)
    backend.tokenizer.hf.chat_template = TEMPLATE
    yield backend
    backend.close()


def rag(order, max_tokens=8, n=1, model=f"spnl/{MODEL}"):
    """spnl's RAG query: the documents as a plus group between a system prompt and the
    question, as spnl sends it after its warm-up."""
    docs = {"plus": [{"user": DOCS[i]} for i in order]}
    question = [{"user": "What do they say?"}, {"user": "Answer briefly."}]
    g = {"model": model, "input": {"cross": [{"system": SYSTEM}, docs, *question]}}
    return {"repeat": {"n": n, "g": {**g, "max_tokens": max_tokens, "temperature": 0}}}


def warm_up(inputs, max_tokens=1):
    meta = {"model": f"spnl/{MODEL}", "max_tokens": max_tokens, "temperature": 0}
    return {"map": {"metadata": meta, "inputs": inputs}}


def reset(live):
    response = httpx.post(live.url + "/reset_prefix_cache", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_streamed_repeat_is_the_python_apis_answer(live, backend):
    reset(live)
    answer = execute_spnl(live.url, rag([0, 1, 2]))
    expected = backend.query(query_json(rag([0, 1, 2])))
    assert answer.texts == [r.text for r in expected]
    assert answer.texts[0]
    assert answer.dropped == []  # every chunk parses as spnl's client parses it
    assert answer.usage["prompt_tokens_details"]["pic_miss_tokens"] > 0


def test_repeat_n_gives_n_choices(live, backend):
    answer = execute_spnl(live.url, rag([2, 0], n=3))
    expected = backend.query(query_json(rag([2, 0])))[0].text
    assert answer.texts == [expected] * 3


def test_a_map_of_one_token_is_answered_whole_in_input_order(live, backend):
    answer = execute_spnl(live.url, warm_up(DOCS))
    expected = [r.text for r in backend.query(query_json(warm_up(DOCS)))]
    assert answer.texts == expected
    assert len(answer.texts) == len(DOCS)


def test_a_longer_map_is_streamed_per_input(live, backend):
    answer = execute_spnl(live.url, warm_up(DOCS[:3], max_tokens=5))
    assert answer.texts == [r.text for r in backend.query(query_json(warm_up(DOCS[:3], 5)))]
    assert answer.dropped == []


def test_a_warm_up_map_makes_every_document_hit_in_any_order(live):
    """spnl's RAG flow: a one-token map over the fragments, then the query with them in
    a shuffled order; every plus token comes from the pool (spnl's reuse rule)."""
    reset(live)
    execute_spnl(live.url, warm_up(DOCS))
    order = list(range(len(DOCS)))
    random.Random(1).shuffle(order)
    details = execute_spnl(live.url, rag(order)).usage["prompt_tokens_details"]
    assert details["pic_miss_tokens"] == 0
    assert details["pic_hit_tokens"] > sum(len(d) for d in DOCS) // 4
    metrics = httpx.get(live.url + "/metrics").text
    assert 'spnl_requests_total{endpoint="query",outcome="ok"}' in metrics
    assert "spnl_pic_hit_tokens" in metrics


def test_a_whole_repeat_is_a_chat_completion(live, backend):
    query = rag([1, 0], max_tokens=1)
    answer = execute_spnl(live.url, query)  # max_tokens 1: not streamed
    assert answer.texts == [r.text for r in backend.query(query_json(query)) if r.text]


def test_the_openai_flattening_reaches_the_same_server(live):
    """What spnl's ``openai/`` provider sends for the same query: plain chat."""
    answer = execute_openai(live.url, rag([0, 1], model=f"openai/{MODEL}"))
    assert answer.texts[0]
    assert answer.usage is None or "pic_hit_tokens" in answer.usage["prompt_tokens_details"]


def _post(live, body, stream="true", headers=None):
    headers = {"Content-Type": "text/plain", **(headers or {})}
    return httpx.post(
        live.url + "/v1/query/execute",
        params={"stream": stream},
        content=body if isinstance(body, bytes) else body.encode(),
        headers=headers,
        timeout=30,
    )


@pytest.mark.parametrize(
    ("body", "status", "said"),
    [
        ("{not json", 400, "not valid JSON"),
        (json.dumps({"repeat": {"n": 1, "g": {"model": MODEL}}}), 400, "missing input"),
        (json.dumps({"repeat": {"n": 1, "x": 2, "g": {}}}), 400, "unknown key"),
        (json.dumps({"bulk": {}}), 400, "unknown key 'bulk'"),
        (json.dumps({"repeat": {"n": 300, "g": {}}}), 400, "from 0 to 255"),
        (
            json.dumps({"repeat": {"n": 1, "g": {"model": MODEL, "input": {"cross": []}}}}),
            400,
            "cross is empty",
        ),
        (
            json.dumps({"repeat": {"n": 1, "g": {"model": MODEL, "input": {"user": 3}}}}),
            400,
            "expected the message's text",
        ),
        (
            json.dumps(
                {"repeat": {"n": 1, "g": {"model": MODEL, "color": 1, "input": {"user": "a"}}}}
            ),
            400,
            "unknown key(s) 'color'",
        ),
        (
            json.dumps({"repeat": {"n": 1, "g": {"model": MODEL, "input": {"g": {}}}}}),
            400,
            "nested generate",
        ),
        (
            json.dumps(
                {
                    "repeat": {
                        "n": 1,
                        "g": {"model": MODEL, "max_tokens": -1, "input": {"user": "a"}},
                    }
                }
            ),
            400,
            "max_tokens",
        ),
        (
            json.dumps(
                {
                    "repeat": {
                        "n": 1,
                        "g": {"model": MODEL, "temperature": "hot", "input": {"user": "a"}},
                    }
                }
            ),
            400,
            "temperature",
        ),
        (json.dumps({"map": {"metadata": {"model": MODEL}, "inputs": []}}), 400, "non-empty"),
        (
            json.dumps({"map": {"metadata": {"model": "other"}, "inputs": ["a"]}}),
            404,
            "does not exist here",
        ),
        (b"\xff\xfe", 400, "not UTF-8"),
        (
            json.dumps({"repeat": {"n": 1, "g": {"model": MODEL, "input": {"user": "\ud800"}}}}),
            400,
            "valid Unicode",
        ),
    ],
)
def test_bad_queries_are_4xx_in_openais_shape(live, body, status, said):
    response = _post(live, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert said in error["message"]
    assert error["type"]


def test_deep_and_wide_queries_are_refused_not_crashed(live):
    deep = {"user": "x"}
    for _ in range(100):
        deep = {"seq": [deep]}
    body = {"repeat": {"n": 1, "g": {"model": MODEL, "input": deep}}}
    assert _post(live, json.dumps(body)).status_code == 400
    nested = "[" * 100_000 + "]" * 100_000
    assert _post(live, nested).status_code == 400


def test_stream_must_say_true_or_false(live):
    response = _post(live, query_json(rag([0])), stream="maybe")
    assert response.status_code == 400
    assert "stream" in response.json()["error"]["message"]


def test_a_text_body_from_a_web_page_is_refused(live):
    """text/plain is what a page may POST without asking; a browser names its page."""
    response = _post(live, query_json(rag([0])), headers={"Origin": "http://evil.example"})
    assert response.status_code == 403
    as_json = httpx.post(
        live.url + "/v1/query/execute",
        content=query_json(rag([0])),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert as_json.status_code == 200
    form_type = {"Content-Type": "application/x-www-form-urlencoded"}
    form = _post(live, "a=b", headers=form_type)  # from no browser: read, and not JSON
    assert form.status_code == 400
    page_form = _post(live, "a=b", headers={**form_type, "Origin": "http://evil.example"})
    assert page_form.status_code == 403


def test_reset_prefix_cache_leaves_running_requests_alone(live, backend):
    """A reset while a stream runs (its first text read, the rest to come): the stream
    finishes as it would have; the next request computes its prompt again."""
    query = rag([0, 1, 2, 3], max_tokens=24)
    expected = backend.query(query_json(query))[0].text
    text, forgotten = "", None
    with httpx.stream(
        "POST",
        live.url + "/v1/query/execute",
        params={"stream": "true"},
        content=query_json(query),
        headers={"Content-Type": "text/plain"},
        timeout=60,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(choice["text"] for choice in chunk["choices"])
                if text and forgotten is None:
                    forgotten = reset(live)["forgotten"]
    assert text == expected
    assert forgotten > 0  # the running sequence's blocks were cached too
    again = execute_spnl(live.url, query).usage["prompt_tokens_details"]
    assert again["pic_hit_tokens"] == 0
    assert again["cached_tokens"] == 0


def test_the_usage_chunk_and_every_text_chunk_parse_as_spnls_client_reads_them(live):
    response = _post(live, query_json(rag([3, 1], max_tokens=6)))
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    for chunk in chunks:
        check_completion(chunk)
        assert chunk["object"] == "text_completion"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["total_tokens"] > 0


def test_the_key_guards_both_routes(backend):
    server = LiveServer(backend, api_key="sesame")
    try:
        assert _post(server, query_json(rag([0]))).status_code == 401
        assert httpx.post(server.url + "/reset_prefix_cache").status_code == 401
        ok = httpx.post(
            server.url + "/reset_prefix_cache", headers={"Authorization": "Bearer sesame"}
        )
        assert ok.status_code == 200
    finally:
        server.stop()
