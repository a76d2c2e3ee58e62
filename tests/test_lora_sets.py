"""Several LoRA adapters in one request, speculation with adapters, and PIC under adapters.

A row of several adapters adds each one's product at its scale: the same as transformers
with every adapter merged into the weights at those scales. The prefix, PIC and KV tier
keys depend on the whole set of (adapter, scale), so no K/V is shared between sets. N-gram
and suffix speculation verify with the request's adapters (greedy tokens as without
speculation); a draft model proposes from the base and the target verifies with them.
"""

import copy
import json
import math

import httpx
import pytest
import torch
from helpers import engine_internals, greedy_with_logits, run_together
from test_lora import LONG_IDS, PROMPT_IDS, TOKENS, _backend, adapters, hf_greedy, merged
from tiny_models import write_adapter

from spnl_backend import BackendSettings, load_backend
from spnl_backend.errors import RequestError
from spnl_backend.kernels.lora_ref import LoraPair, LoraSite, LoraStep, lora_delta_ref
from spnl_backend.models.lora import scaled_root, set_root
from spnl_backend.request import sampling_params

__all__ = ["adapters"]  # the fixture, shared with test_lora

PAIR = {"one": 1.0, "two": 0.5}  # each row adds one's product and half of two's
BLOCKS = [("plus", LONG_IDS[:20]), ("plus", LONG_IDS[20:45]), ("cross", LONG_IDS[45:])]


def _pairs(tiny_model, where: str) -> tuple[dict, dict]:
    """The (A, B) matrices of the fixture's adapters "one" and "two" (same seeds)."""
    root = tiny_model.path.parent / where
    one = write_adapter(root / "one", tiny_model.hf, seed=1)
    two = write_adapter(root / "two", tiny_model.hf, seed=2, rank=8, use_rslora=True)
    return one, two


def _generate(backend, ids=PROMPT_IDS, tokens=TOKENS, **options):
    """Greedy tokens and each token's top log-probabilities (bits of the row's logits)."""
    result = backend.generate(
        prompt_token_ids=ids,
        max_tokens=tokens,
        temperature=0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=5,
        **options,
    )
    return result.token_ids, result.logprobs


def test_a_request_takes_several_adapters():
    asked = sampling_params(adapters={"two": 0.5, "one": 1, "three": 0})
    assert asked.adapters == (("one", 1.0), ("two", 0.5))  # by name, the one at 0 left out
    assert sampling_params(adapters=["one", ("two", 2)]).adapters == (("one", 1.0), ("two", 2.0))
    assert sampling_params(adapter="one", adapter_scale=0.5).adapters == (("one", 0.5),)
    assert sampling_params(adapters="one").adapters == (("one", 1.0),)
    for bad, message in (
        ({"adapters": ["one", "one"]}, "named twice"),
        ({"adapters": [("one", 200)]}, "from -100 to 100"),
        ({"adapters": [("one",)]}, "expected a LoRA adapter's name, a list"),
        ({"adapters": 3}, "expected a LoRA adapter's name, a list"),
        ({"adapters": [""]}, "the name of a loaded LoRA adapter"),
        ({"adapter": "one", "adapters": ["two"]}, "adapter and adapters"),
    ):
        with pytest.raises(RequestError, match=message):
            sampling_params(**bad)


def test_set_roots_are_canonical():
    one, two = scaled_root(11, 1.0), scaled_root(22, 0.5)
    assert set_root([]) == 0
    assert set_root([one]) == one  # one adapter keeps its own root
    assert set_root([one, two]) == set_root([two, one])
    assert set_root([one, two]) not in (one, two, set_root([one, scaled_root(22, 1.0)]))


def test_a_row_in_several_groups_adds_each_product_in_group_order():
    """The step's contract: a row may be in several ``(slot, factor, rows)`` groups, and
    gets each group's product added in the order of the groups."""
    gen = torch.Generator().manual_seed(3)
    x, out = torch.randn(5, 24, generator=gen), torch.randn(5, 16, generator=gen)
    a1, b1 = torch.randn(4, 24, generator=gen), torch.randn(16, 4, generator=gen)
    a2, b2 = torch.randn(8, 24, generator=gen), torch.randn(16, 8, generator=gen)
    step = LoraStep([(0, 1.0, torch.tensor([0, 2, 3])), (1, 0.5, torch.tensor([2, 4]))])
    site = LoraSite(step)
    site.pairs = {0: LoraPair(a1, b1, 2.0), 1: LoraPair(a2, b2, 0.25)}
    got = site.add(x, out)
    want = out.clone()
    want[[0, 2, 3]] += lora_delta_ref(x[[0, 2, 3]], a1, b1, 2.0)
    want[[2, 4]] += lora_delta_ref(x[[2, 4]], a2, b2, 0.125)
    assert torch.equal(got, want)
    assert torch.equal(got[1], out[1])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_several_adapters_equal_their_merged_weights(adapters, arch):
    tiny_model, spec, _ = adapters(arch)
    backend = _backend(str(tiny_model.path), spec, paged_cache_type="f32")
    one, two = _pairs(tiny_model, "sets")
    ref = merged(merged(tiny_model.hf, one, 8.0 / 4 * PAIR["one"]), two, 8.0 / math.sqrt(8) / 2)
    want, want_logits = hf_greedy(ref, PROMPT_IDS, TOKENS)
    for single in ("one", "two"):
        assert want != _generate(backend, adapter=single)[0]  # both adapters count
    got, logits, _ = greedy_with_logits(
        backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapters=PAIR, ignore_eos=True
    )
    assert got == want
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    swapped = greedy_with_logits(
        backend,
        TOKENS,
        prompt_token_ids=PROMPT_IDS,
        adapters=[("two", 0.5), ("one", 1.0)],
        ignore_eos=True,
    )
    assert swapped[0] == got
    assert torch.equal(swapped[1], logits)  # the same set: the same bits, in any order


def test_sets_batch_with_the_base_and_single_adapters(adapters):
    """Each request's tokens and log-probabilities, bit for bit, alone and in one step
    with the base, single adapters and other sets (batch invariance)."""
    tiny_model, spec, _ = adapters("llama")
    backend = _backend(str(tiny_model.path), spec, prefix_cache_n=0, isq="Q8_0")  # int8 products
    asks = [{}, {"adapter": "one"}, {"adapter": "two"}, {"adapters": PAIR}]
    asks.append({"adapters": {"one": -1.0, "two": 0.5}})  # (two, 0.5) as in the pair
    alone = [_generate(backend, **ask) for ask in asks]
    assert len({tuple(tokens) for tokens, _ in alone}) == len(asks)
    calls = [lambda ask=ask: _generate(backend, **ask) for ask in asks]
    together = run_together(backend, *calls, *reversed(calls))
    assert together == alone + alone[::-1]


def test_prefix_cache_is_kept_per_set(adapters):
    tiny_model, spec, _ = adapters("llama")
    plain = _backend(str(tiny_model.path), spec, prefix_cache_n=0)
    backend = _backend(str(tiny_model.path), spec)
    backend.reset_prefix_cache()

    def cached(**ask) -> int:
        result = backend.generate(prompt_token_ids=LONG_IDS, max_tokens=4, temperature=0, **ask)
        assert result.token_ids == _greedy_plain(plain, **ask)
        return result.usage.cached_tokens

    for ask in ({}, {"adapter": "one"}, {"adapter": "two"}):
        assert cached(**ask) == 0
    assert cached(adapters=PAIR) == 0  # neither the base's, nor one's, nor two's blocks
    assert cached(adapters={"one": 1.0, "two": 1.0}) == 0  # another scale: another set
    assert cached(adapters=[("two", 0.5), "one"]) > 0  # the same set, named in another order


def _greedy_plain(plain, **ask) -> list[int]:
    return plain.generate(prompt_token_ids=LONG_IDS, max_tokens=4, temperature=0, **ask).token_ids


def test_a_request_cannot_name_more_adapters_than_are_held(adapters):
    tiny_model, spec, _ = adapters("llama")
    backend = _backend(str(tiny_model.path), spec, lora_max_loaded=1, prefix_cache_n=0)
    assert _generate(backend, adapter="two")[0] == _generate(backend, adapter="two")[0]
    with pytest.raises(RequestError, match=r"2 LoRA adapters in one request.*MAX_LOADED"):
        backend.generate(prompt_token_ids=PROMPT_IDS, max_tokens=2, adapters=PAIR)
    with pytest.raises(RequestError, match="no LoRA adapter of that name"):
        backend.generate(prompt_token_ids=PROMPT_IDS, max_tokens=2, adapters=["one", "three"])


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_lookup_speculation_verifies_with_the_adapters(adapters, method):
    """Draft-free proposals verified by each request's own adapters, the base's, one
    adapter's and a set's requests in one step: greedy tokens as without speculation,
    with proposals verified and some accepted."""
    tiny_model, spec, _ = adapters("llama")
    plain = _backend(str(tiny_model.path), spec, prefix_cache_n=0)
    fast = _backend(str(tiny_model.path), spec, prefix_cache_n=0, speculative_method=method)
    asks = [{}, {"adapter": "one"}, {"adapters": PAIR}]
    # Each prompt holds its own greedy continuation: proposals to find in it.
    prompts = [PROMPT_IDS + _generate(plain, PROMPT_IDS, 40, **a)[0] + PROMPT_IDS for a in asks]
    wants = [_generate(plain, ids, 24, **a)[0] for ids, a in zip(prompts, asks, strict=True)]
    assert len({tuple(want) for want in wants}) == len(asks)
    drafted = accepted = 0
    for _ in range(2):  # the second time, suffix also proposes from the first's outputs
        calls = [
            lambda ids=ids, a=a: fast.generate(
                prompt_token_ids=ids, max_tokens=24, temperature=0, ignore_eos=True, **a
            )
            for ids, a in zip(prompts, asks, strict=True)
        ]
        results = run_together(fast, *calls)
        assert [r.token_ids for r in results] == wants
        drafted += sum(r.usage.draft_tokens for r in results)
        accepted += sum(r.usage.accepted_tokens for r in results)
    assert drafted > 0
    assert accepted > 0


def test_a_draft_model_proposes_from_the_base_and_the_target_verifies(adapters):
    """With a draft model: its tokens (and its cache) are the base's, the target's are
    the adapters': greedy tokens as without speculation."""
    tiny_model, spec, _ = adapters("llama")
    plain = _backend(str(tiny_model.path), spec, prefix_cache_n=0)
    paired = _backend(str(tiny_model.path), spec, speculative_draft_model=str(tiny_model.path))
    drafted = 0
    for ask in ({"adapter": "one"}, {"adapters": PAIR}, {}):
        result = paired.generate(
            prompt_token_ids=LONG_IDS, max_tokens=12, temperature=0, ignore_eos=True, **ask
        )
        assert result.token_ids == _generate(plain, LONG_IDS, 12, **ask)[0], ask
        drafted += result.usage.draft_tokens
        if not ask:  # the base's own run: every draft the same model's, all accepted
            assert result.usage.accepted_tokens == result.usage.draft_tokens > 0
    assert drafted > 0
    draft = engine_internals(paired).runner.drafter.model
    assert draft.adapters is None  # the draft model carries no adapter


def test_an_adapter_loaded_later_runs_under_speculation(adapters):
    """A backend built with n-gram speculation and no adapter takes one at run time."""
    tiny_model, spec, _ = adapters("llama")
    plain = _backend(str(tiny_model.path), spec, prefix_cache_n=0)
    settings = BackendSettings(device="cpu", speculative_method="ngram", prefix_cache_n=0)
    with load_backend(str(tiny_model.path), settings=settings) as fast:
        fast.load_adapter("one", spec.split(",")[0].split("=", 1)[1])
        assert _generate(fast, adapter="one")[0] == _generate(plain, adapter="one")[0]


def test_pic_blocks_are_kept_per_set(adapters):
    """A plus element cached under one adapter set is read back under that set only; a hit
    equals a cold run bit for bit."""
    tiny_model, spec, _ = adapters("llama")
    for reuse in ("exact", "tokens"):
        backend = _backend(str(tiny_model.path), spec, pic_reuse=reuse, isq="Q8_0")
        backend.reset_prefix_cache()

        def run(backend=backend, blocks=BLOCKS, **ask):
            result = backend.generate(
                blocks=blocks, max_tokens=4, temperature=0, logprobs=True, **ask
            )
            return result.token_ids, result.logprobs, result.usage.pic_hit_tokens

        outputs = {}
        for name, ask in (("one", {"adapter": "one"}), ("pair", {"adapters": PAIR})):
            tokens, logprobs, hits = run(**ask)
            assert hits == 0, (reuse, name)  # no other adapter's nor set's elements
            again = run(**ask)
            assert again[2] > 0, (reuse, name)
            assert again[:2] == (tokens, logprobs)
            outputs[name] = tokens
        base = run()
        assert base[2] == 0, reuse
        assert run(adapter="two")[2] == 0, reuse
        assert run(adapters={"one": 1.0, "two": 0.25})[2] == 0, reuse
        assert len({tuple(outputs["one"]), tuple(outputs["pair"]), tuple(base[0])}) == 3


def test_kv_tier_keeps_sets_apart(adapters, tmp_path):
    """The KV tier's blocks of an adapter set are read back under that set alone."""
    tiny_model, spec, _ = adapters("llama")
    settings = BackendSettings(
        device="cpu", paged_attn_block_size=16, lora_adapters=spec, kv_tier_dir=str(tmp_path)
    )

    def run(backend, **ask):
        result = backend.generate(prompt_token_ids=LONG_IDS, max_tokens=4, temperature=0, **ask)
        return result.token_ids, result.usage.tier_hit_tokens

    with load_backend(str(tiny_model.path), settings=settings) as first:
        pair, _ = run(first, adapters=PAIR)
        engine_internals(first).cache.tier.tier.flush()
    with load_backend(str(tiny_model.path), settings=settings) as second:
        for ask in ({}, {"adapter": "one"}, {"adapters": {"one": 1.0, "two": 1.0}}):
            assert run(second, **ask)[1] == 0, ask
        tokens, hits = run(second, adapters=PAIR)
        assert hits > 0
        assert tokens == pair


def _span_query(model: str) -> dict:
    docs = {"plus": [{"user": f"Document {i} says {'abc'[i]} twice over."} for i in range(3)]}
    g = {"model": model, "input": {"cross": [{"system": "Read."}, docs, {"user": "Why?"}]}}
    return {"repeat": {"n": 1, "g": {**g, "max_tokens": 4, "temperature": 0}}}


def test_span_queries_take_adapters_and_keep_their_documents_apart(adapters):
    """A span query's plus documents, cached under one adapter set, are read back under
    that set alone: in the Python API (``adapters=``) and at /v1/query/execute, whose
    ``model`` may name an adapter."""
    from live_server import MODEL, TEMPLATE, LiveServer

    tiny_model, spec, _ = adapters("llama")
    backend = _backend(str(tiny_model.path), spec, isq="Q8_0", span_query_reuse="tokens")
    backend.tokenizer.hf.chat_template = TEMPLATE  # turns a span query's messages render in
    backend.reset_prefix_cache()
    query = _span_query(MODEL)

    def hits(**ask) -> tuple[str, int]:
        result = backend.query(query, **ask)[0]
        return result.text, result.usage.pic_hit_tokens

    pair, none = hits(adapters=PAIR)
    assert none == 0
    again, warm = hits(adapters=PAIR)
    assert again == pair
    assert warm > 0
    base, none = hits()
    assert none == 0  # the pair's documents are not the base's
    assert hits(adapters="one")[1] == 0
    assert len({pair, base, hits(adapters="one")[0]}) == 3
    server = LiveServer(backend)
    try:
        answer = httpx.post(
            server.url + "/v1/query/execute",
            params={"stream": "false"},
            content=json.dumps(_span_query("one")),
            headers={"Content-Type": "text/plain"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["message"]["content"] == hits(adapters="one")[0]
        assert body["usage"]["prompt_tokens_details"]["pic_hit_tokens"] > 0  # one's own
    finally:
        server.stop()


def test_several_adapters_equal_peft_merging_them(adapters):
    """PEFT's own model of the same adapter directories, both active at the request's
    scales and merged into the base: the same greedy tokens and logits."""
    peft = pytest.importorskip("peft")
    from peft.tuners.lora import LoraLayer

    tiny_model, spec, _ = adapters("llama")
    paths = dict(entry.split("=", 1) for entry in spec.split(","))
    model = peft.PeftModel.from_pretrained(
        copy.deepcopy(tiny_model.hf), paths["one"], adapter_name="one"
    )
    model.load_adapter(paths["two"], adapter_name="two")
    model.base_model.set_adapter(["one", "two"])
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, factor in PAIR.items():
                module.set_scale(name, factor)
    reference = model.merge_and_unload(adapter_names=list(PAIR)).eval()
    want, want_logits = hf_greedy(reference, PROMPT_IDS, TOKENS)
    backend = _backend(str(tiny_model.path), spec, paged_cache_type="f32")
    got, logits, _ = greedy_with_logits(
        backend, TOKENS, prompt_token_ids=PROMPT_IDS, adapters=PAIR, ignore_eos=True
    )
    assert got == want
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert want != hf_greedy(tiny_model.hf, PROMPT_IDS, TOKENS)[0]
