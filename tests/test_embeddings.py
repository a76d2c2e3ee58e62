"""Embeddings: the model's last hidden states pooled and normalized, a text's vector the
same whatever it comes with, through the Python API and OpenAI's ``/v1/embeddings`` with
the official client."""

import base64

import numpy as np
import pytest
import torch
from helpers import CPU
from live_server import MODEL
from transformers import AutoModelForCausalLM

from spnl_backend import load_backend
from spnl_backend.engine.embed import SelfAttention, embed
from spnl_backend.errors import RequestError
from spnl_backend.models.step_attention import AttentionSpec

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
    spec = AttentionSpec(layer=0, scale=0.5, num_kv_groups=1)
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


def test_embeddings_between_generation_steps(live, backend):
    """A stream and embeddings at once: both answered, the stream's text as alone."""
    alone = backend.generate(TEXTS[1], max_tokens=24, temperature=0).text
    stream = backend.stream(TEXTS[1], max_tokens=24, temperature=0)
    first = next(stream)
    vectors = backend.embed(TEXTS * 4).vectors
    assert first + "".join(stream) == alone
    assert vectors.shape[0] == 12
