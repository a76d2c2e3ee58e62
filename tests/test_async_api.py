"""The asyncio API and the engine loop under it: concurrent `astream`s get their serial
tokens, cancelling or failing one consumer aborts only its request, and a prompt's
``n`` completions compute it once."""

import asyncio

import pytest
from helpers import CPU
from live_server import TEMPLATE

from spnl_backend import BackendSettings, RequestError, load_backend
from spnl_backend.sampling import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time there was", "def add(a, b):"]


@pytest.fixture(scope="module")
def backend(tiny):
    backend = load_backend(str(tiny.hf("qwen3").path), settings=CPU)
    yield backend
    backend.close()


def _clean(backend) -> bool:
    stats = backend.stats()
    return (stats.running, stats.waiting, stats.cache_holders) == (0, 0, 0)


def _tokens(results):
    return [r.token_ids for r in results] if isinstance(results, list) else results.token_ids


def test_agenerate_and_achat_equal_their_blocking_twins(backend, monkeypatch):
    expected = backend.generate(PROMPTS, max_tokens=10, temperature=0)
    got = asyncio.run(backend.agenerate(PROMPTS, max_tokens=10, temperature=0))
    assert _tokens(got) == _tokens(expected)
    monkeypatch.setattr(backend.tokenizer.hf, "chat_template", TEMPLATE)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = backend.chat(messages, max_tokens=10, temperature=0)
    assert asyncio.run(backend.achat(messages, max_tokens=10, temperature=0)).text == chat.text


def test_many_concurrent_astreams_equal_their_serial_runs(backend):
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(24)]
    serial = [backend.generate(p, max_tokens=16, temperature=0).text for p in prompts]

    async def one(prompt):
        return "".join(
            [piece async for piece in backend.astream(prompt, max_tokens=16, temperature=0)]
        )

    async def everyone():
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(everyone()) == serial
    assert _clean(backend)


def test_cancelling_a_consumer_aborts_its_request_only(backend):
    alone = backend.generate(PROMPTS[1], max_tokens=24, temperature=0).text

    async def endless():
        async for _ in backend.astream(PROMPTS[0], max_tokens=10_000, temperature=0):
            pass

    async def scenario():
        task = asyncio.create_task(endless())
        other = asyncio.create_task(backend.agenerate(PROMPTS[1], max_tokens=24, temperature=0))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return (await other).text

    assert asyncio.run(scenario()) == alone
    assert _clean(backend)


def test_an_exception_in_one_consumer_leaves_the_others_alone(backend):
    serial = [backend.generate(p, max_tokens=12, temperature=0).text for p in PROMPTS]

    async def consume(prompt, fail):
        text = ""
        async for piece in backend.astream(prompt, max_tokens=12, temperature=0):
            text += piece
            if fail:
                raise ValueError("the consumer's own bug")
        return text

    async def scenario():
        return await asyncio.gather(
            *(consume(p, fail=i == 1) for i, p in enumerate(PROMPTS)), return_exceptions=True
        )

    results = asyncio.run(scenario())
    assert isinstance(results[1], ValueError)
    assert [results[0], results[2]] == [serial[0], serial[2]]
    assert _clean(backend)


def test_bad_parameters_raise_when_astream_is_called(backend):
    with pytest.raises(RequestError, match="temperature"):
        backend.astream(PROMPTS[0], temperature=-1)
    with pytest.raises(RequestError, match="exactly one"):
        asyncio.run(backend.agenerate())


def test_token_id_prompts(backend):
    ids = backend.tokenizer.encode(PROMPTS[2])
    by_text = backend.generate(PROMPTS[2], max_tokens=8, temperature=0)
    by_ids = backend.generate(prompt_token_ids=ids, max_tokens=8, temperature=0)
    assert _tokens(by_ids) == _tokens(by_text)
    pair = backend.generate(prompt_token_ids=[ids, ids], max_tokens=8, temperature=0)
    assert _tokens(pair) == [by_text.token_ids] * 2
    assert "".join(backend.stream(prompt_token_ids=ids, max_tokens=8, temperature=0)) == (
        by_text.text
    )
    for bad in ([], [-1], [10**9], [[1], []], "abc", [1.5]):
        with pytest.raises(RequestError, match="prompt_token_ids"):
            backend.generate(prompt_token_ids=bad)
    with pytest.raises(RequestError, match="exactly one"):
        backend.generate(PROMPTS[0], prompt_token_ids=ids)


@pytest.mark.parametrize("prefix_cache", [0, 16], ids=["prefix-cache-off", "prefix-cache-on"])
def test_n_completions_compute_their_prompt_once(tiny, prefix_cache):
    settings = BackendSettings(
        device="cpu", paged_attn=True, paged_attn_block_size=8, prefix_cache_n=prefix_cache
    )
    backend = load_backend(str(tiny.hf("qwen3").path), settings=settings)
    ids = backend.tokenizer.encode(" ".join(PROMPTS))
    assert len(ids) > 8
    request = backend.submit([ids], SamplingParams(max_tokens=6, temperature=0), n=3)
    for _ in request.items():
        pass
    _, *others = request.seqs
    shared = (len(ids) - 1) // 8 * 8  # every full block but one that holds the last token
    assert [seq.num_cached_tokens for seq in others] == [shared, shared]
    alone = backend.generate(prompt_token_ids=ids, max_tokens=6, temperature=0).token_ids
    assert [seq.output_token_ids for seq in request.seqs] == [alone] * 3
    assert _clean(backend)
    backend.close()
