"""Embeddings: the model's last hidden states pooled and normalized, a text's vector the
same whatever it comes with, through the Python API and OpenAI's ``/v1/embeddings`` with
the official client."""

import asyncio
import base64
import dataclasses
import json
import socket
import threading
import time

import numpy as np
import pytest
import torch
from helpers import CPU, loop_held, run_together
from live_server import MODEL
from starlette.responses import JSONResponse
from transformers import AutoModelForCausalLM

from spnl_backend import load_backend
from spnl_backend.engine.embed import SelfAttention, embed
from spnl_backend.errors import RequestAbortedError, RequestError
from spnl_backend.kernels.scoring import Scoring
from spnl_backend.models.step_attention import AttentionSpec
from spnl_backend.server import app, protocol, responses
from spnl_backend.server.responses import embedding_body, json_piecewise

TEXTS = ["The quick brown fox", "Once upon a time there was a little model", "def add(a, b):"]


@pytest.fixture(scope="module")
def backend(tiny):
    backend = load_backend(str(tiny.hf("llama").path), settings=CPU)
    yield backend
    backend.close()


def _reference(tiny, backend, text: str, pooling: str) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(str(tiny.hf("llama").path))
    ids = torch.tensor([backend.tokenizer.encode(text)])
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states[-1][0]
    pooled = {"last": states[-1], "mean": states.mean(0), "first": states[0]}[pooling]
    return torch.nn.functional.normalize(pooled, dim=0)


def test_embeddings_are_the_pooled_last_hidden_states(tiny, backend):
    vectors = backend.embed(TEXTS).vectors
    assert vectors.shape == (3, backend.model_config.hidden_size)
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(3))
    for text, vector in zip(TEXTS, vectors, strict=True):
        torch.testing.assert_close(
            vector, _reference(tiny, backend, text, "last"), atol=2e-5, rtol=0
        )
    runner = backend._loop.engine.runner
    ids = [backend.tokenizer.encode(TEXTS[1])]
    for pooling in ("mean", "first"):
        pooled = embed(runner.model, runner.device, ids, pooling)[0]
        expected = _reference(tiny, backend, TEXTS[1], pooling)
        torch.testing.assert_close(pooled, expected, atol=2e-5, rtol=0)


def test_a_texts_embedding_does_not_depend_on_its_batch(backend):
    alone = [backend.embed(text).vectors[0] for text in TEXTS]
    together = backend.embed(TEXTS * 3).vectors
    for i, vector in enumerate(together):
        assert torch.equal(vector, alone[i % 3])


def test_self_attention_keeps_packed_texts_apart():
    q, k, v = (torch.randn(7, 2, 4) for _ in range(3))
    spec = AttentionSpec(layer=0, num_kv_groups=1, scoring=Scoring(0.5))
    both = SelfAttention([3, 4]).attend(q, k, v, spec)
    second = SelfAttention([4]).attend(q[3:], k[3:], v[3:], spec)
    torch.testing.assert_close(both[3:], second)


def test_token_ids_and_bad_inputs(backend):
    ids = backend.tokenizer.encode(TEXTS[0])
    assert torch.equal(backend.embed([ids]).vectors[0], backend.embed(TEXTS[0]).vectors[0])
    assert torch.equal(backend.embed(ids).vectors[0], backend.embed(TEXTS[0]).vectors[0])
    with pytest.raises(RequestError, match="empty"):
        backend.embed("")
    with pytest.raises(RequestError, match="token ids"):
        backend.embed([[10**9]])
    with pytest.raises(RequestError, match="tokens"):
        backend.embed("word " * 2000)


def test_openai_client_floats_base64_and_dimensions(live, backend):
    client = live.client()
    reply = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in reply.data] == [0, 1, 2]
    expected = backend.embed(TEXTS).vectors
    got = torch.tensor([d.embedding for d in reply.data])
    torch.testing.assert_close(got, expected)
    assert reply.usage.prompt_tokens == sum(backend.embed(TEXTS).token_counts)
    raw = live.post(
        "/v1/embeddings", {"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(decoded.copy()), expected[0])
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=8)
    vector = torch.tensor(short.data[0].embedding)
    torch.testing.assert_close(vector, torch.nn.functional.normalize(expected[0, :8], dim=0))
    ids = client.embeddings.create(model=MODEL, input=[backend.tokenizer.encode(TEXTS[2])])
    torch.testing.assert_close(torch.tensor(ids.data[0].embedding), expected[2])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 100000}, "dimensions"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": "x", "truncate": True}, "truncate"),
        ({"input": "word " * 3000}, "input"),
    ],
)
def test_bad_embedding_requests_are_400_naming_the_field(live, body, param):
    reply = live.post("/v1/embeddings", {"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_both_apis_cap_the_inputs_alike(live):
    reply = live.post("/api/embed", {"model": MODEL, "input": ["x"] * 2049})
    assert reply.status_code == 400, reply.text
    assert "at most 2048" in reply.json()["error"]
    assert live.post("/api/embed", {"model": MODEL, "input": ["x"] * 2048}).status_code == 200


def test_an_answer_over_the_values_bound_is_refused_up_front(live, backend, monkeypatch):
    hidden = backend.model_config.hidden_size
    monkeypatch.setattr(protocol, "MAX_EMBEDDING_VALUES", 2 * hidden)
    computed = []
    with monkeypatch.context() as patched:
        patched.setattr(backend._loop.engine, "embed", computed.append)
        openai_reply = live.post("/v1/embeddings", {"model": MODEL, "input": TEXTS})
        ollama_reply = live.post("/api/embed", {"model": MODEL, "input": TEXTS})
    assert openai_reply.status_code == 400
    assert openai_reply.json()["error"]["param"] == "input"
    assert "at most" in openai_reply.json()["error"]["message"]
    assert ollama_reply.status_code == 400
    assert "fewer dimensions" in ollama_reply.json()["error"]
    assert computed == []  # refused before any text ran
    fewer = {"model": MODEL, "input": TEXTS, "dimensions": hidden // 2}
    assert live.post("/v1/embeddings", fewer).status_code == 200
    assert live.post("/api/embed", fewer).status_code == 200


def test_answers_are_rendered_off_the_event_loop_a_vector_at_a_time(live, monkeypatch):
    """Off the event loop, and in short calls into the JSON encoder: one call over the
    whole answer would hold the GIL, and so the event loop, until it is written."""
    on_the_loop, written = [], []
    encode = responses._json

    def body(*args):
        try:
            on_the_loop.append(asyncio.get_running_loop() is not None)
        except RuntimeError:  # no event loop runs on this thread
            on_the_loop.append(False)
        return embedding_body(*args)

    def logged(value):
        written.append(encode(value))
        return written[-1]

    monkeypatch.setattr(app, "embedding_body", body)
    monkeypatch.setattr(responses, "_json", logged)
    for path in ("/v1/embeddings", "/api/embed"):
        reply = live.post(path, {"model": MODEL, "input": TEXTS})
        assert reply.status_code == 200
        assert max(map(len, written)) < len(reply.content) / len(TEXTS)
        written.clear()
    assert on_the_loop == [False, False]


def test_answers_written_a_vector_at_a_time_are_what_json_response_writes():
    body = {"object": "list", "data": [{"a": [0.25, -1e-9]}, {"b": "é"}], "usage": {"n": 1}}
    assert json_piecewise(body, "data") == JSONResponse(body).body
    assert json_piecewise({"data": []}, "data") == JSONResponse({"data": []}).body


def test_embeddings_between_generation_steps(live, backend):
    """A stream and embeddings at once: both answered, the stream's text as alone."""
    alone = backend.generate(TEXTS[1], max_tokens=24, temperature=0).text
    stream = backend.stream(TEXTS[1], max_tokens=24, temperature=0)
    first = next(stream)
    vectors = backend.embed(TEXTS * 4).vectors
    assert first + "".join(stream) == alone
    assert vectors.shape[0] == 12


# ---- embedding requests in the engine loop -------------------------------------------------


@pytest.fixture
def events(backend, monkeypatch):
    """The engine's steps that ran a batch and its embedding chunks (the texts of each),
    in order; chunks of at most 32 tokens (the texts have 10 to 26)."""
    engine, log = backend._loop.engine, []
    step, embed = engine.step, engine.embed

    def logged_step():
        outputs = step()
        if engine.last_batch_size:
            log.append("step")
        return outputs

    def logged_embed(texts):
        log.append(texts)
        return embed(texts)

    monkeypatch.setattr(engine, "step", logged_step)
    monkeypatch.setattr(engine, "embed", logged_embed)
    config = dataclasses.replace(
        engine.config, max_num_batched_tokens=32, prefill_chunk_while_decoding=32
    )
    monkeypatch.setattr(engine, "config", config)
    return log


def test_a_stream_and_an_embedding_request_advance_in_turn(backend, events):
    ids = [backend.tokenizer.encode(text) for text in TEXTS * 8]
    runner = backend._loop.engine.runner
    one_pass = backend._loop.call(
        lambda engine: embed(runner.model, runner.device, ids, runner.model.config.pooling)
    )
    events.clear()
    generated, embedded = run_together(
        backend,
        lambda: backend.generate(TEXTS[1], max_tokens=8, temperature=0, ignore_eos=True),
        lambda: backend.embed(TEXTS * 8),
    )
    steps = events.count("step")
    assert steps == 8
    assert len(events) > 2 * steps  # the embedding outlasts the stream
    assert events[: 2 * steps : 2] == ["step"] * steps  # a step, a chunk, a step, ...
    chunks = events[1 : 2 * steps : 2]
    assert all(chunk != "step" and sum(map(len, chunk)) <= 32 for chunk in chunks)
    assert torch.equal(embedded.vectors, one_pass)  # however it was chunked
    assert generated.text == backend.generate(TEXTS[1], max_tokens=8, temperature=0).text


def test_embedding_requests_take_chunks_in_turn(backend, events):
    first, second = [backend.tokenizer.encode(t) for t in (TEXTS[0], TEXTS[2])]
    with loop_held(backend):  # both in line before the first chunk
        requests = [backend._loop.embed([ids] * 12) for ids in (first, second)]
    for request in requests:
        request.result()
    order = ["first" if texts[0] == first else "second" for texts in events]
    assert order[:8] == ["first", "second"] * 4


def test_an_aborted_embedding_request_is_dropped_between_chunks(backend, events):
    with loop_held(backend):
        request = backend._loop.embed([backend.tokenizer.encode(TEXTS[0])] * 50)
        request.abort()
    with pytest.raises(RequestAbortedError):
        request.result()
    backend._loop.barrier()
    assert events == []
    assert not backend._loop._embeds


def test_a_client_that_leaves_has_its_embedding_dropped(live, backend, events, monkeypatch):
    loop, engine = backend._loop, backend._loop.engine
    requests, second_chunk, go_on = [], threading.Event(), threading.Event()
    queue, embed_chunk = loop.embed, engine.embed

    def queued(texts):
        requests.append(queue(texts))
        return requests[-1]

    def held(texts):  # the second chunk waits until the client has left
        if len(events) == 1:
            second_chunk.set()
            go_on.wait(30)
        return embed_chunk(texts)

    monkeypatch.setattr(loop, "embed", queued)
    monkeypatch.setattr(engine, "embed", held)
    body = json.dumps({"model": MODEL, "input": TEXTS * 100}).encode()
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
    port = int(live.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(head.encode() + b"Content-Type: application/json\r\n\r\n" + body)
        assert second_chunk.wait(30)
    deadline = time.monotonic() + 30
    while not requests[0].future.cancelled():  # the server saw the client go
        assert time.monotonic() < deadline
        time.sleep(0.01)
    go_on.set()
    loop.barrier()
    assert len(events) == 2  # of some 200 chunks, none more ran
    assert not loop._embeds


def test_a_failing_chunk_fails_its_request_alone(backend, events, monkeypatch):
    engine = backend._loop.engine
    bad, good = [backend.tokenizer.encode(t) for t in (TEXTS[0], TEXTS[2])]
    embed_chunk = engine.embed

    def failing(texts):
        if texts[0] == bad:
            raise RuntimeError("out of memory")
        return embed_chunk(texts)

    monkeypatch.setattr(engine, "embed", failing)
    with loop_held(backend):
        requests = [backend._loop.embed([ids] * 6) for ids in (bad, good)]
    with pytest.raises(RuntimeError, match="out of memory"):
        requests[0].result()
    assert torch.equal(requests[1].result(), backend.embed([good] * 6).vectors)
