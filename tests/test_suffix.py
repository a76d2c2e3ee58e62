"""Suffix speculation (MISTRALRS_SPECULATIVE_METHOD=suffix): n-gram proposals from the
sequence's own tokens, else from a store the requests share (prompts' documents, a PIC
prompt's plus elements one by one, and finished outputs), bounded by a token budget;
verified exactly, so greedy output is the target's alone."""

from functools import cache
from pathlib import Path

import pytest
from helpers import engine_internals
from prometheus_client import generate_latest

from spnl_backend import BackendSettings, SettingsError, load_backend
from spnl_backend.engine.suffix import SuffixRunner, TokenStore
from spnl_backend.request import sampling_params
from spnl_backend.server.metrics import ServerMetrics
from spnl_backend.settings import detect_platform
from spnl_backend.settings.effects import ineffective_settings

DOG = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
CODE = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n"
TOKENS = 24


def load(path: Path, **settings):
    return load_backend(str(path), settings=BackendSettings(device="cpu", **settings))


@pytest.fixture(scope="module")
def trained(tiny):
    """Trained on a small corpus: it continues the copying prompts as they go."""
    return tiny.trained().path


@cache
def _reference(path: Path, prompts: tuple[str, ...]) -> list[list[int]]:
    backend = load(path)
    return [backend.generate(p, max_tokens=TOKENS, temperature=0).token_ids for p in prompts]


# ---- the store ---------------------------------------------------------------------------------


def test_the_store_proposes_what_followed_the_longest_latest_match():
    store = TokenStore(min_n=2, max_n=3, budget_tokens=100)
    store.add([1, 2, 3, 4, 5, 6], "document")
    store.add([9, 2, 3, 7, 8], "output")
    assert store.lookup([0, 1, 2, 3], 3) == ([4, 5, 6], "document")  # [1, 2, 3]: longest
    assert store.lookup([0, 5, 2, 3], 2) == ([7, 8], "output")  # [2, 3]: latest held
    assert store.lookup([4, 4], 2) == ([], None)
    store.add([1, 2, 3, 4, 5, 6], "document")  # held already: refreshed, not held twice
    assert (store.stats().entries, store.stats().tokens) == (2, 11)
    assert store.lookup([5, 2, 3], 1) == ([4], "document")


def test_the_store_drops_the_oldest_past_its_budget_and_its_ngrams_with_it():
    store = TokenStore(min_n=2, max_n=2, budget_tokens=10)
    store.add([1, 2, 3, 4], "document")
    store.add([5, 6, 7, 8], "document")
    store.add([1, 2, 3, 4], "document")  # refreshed: [5, 6, 7, 8] is now the oldest
    store.add([9, 10, 11], "output")  # 11 tokens > 10: the oldest goes
    stats = store.stats()
    assert (stats.entries, stats.tokens, stats.dropped_entries) == (2, 7, 1)
    assert store.lookup([5, 6], 2) == ([], None)
    assert store.lookup([1, 2], 2) == ([3, 4], "document")
    assert all(key in store.entries for key, _ in store.ends.values())  # no stale n-gram
    assert set(store.ends) == {(1, 2), (2, 3), (9, 10)}  # those with a token after them
    store.add(list(range(100, 150)), "output")  # longer than the budget: its first 10
    assert store.stats().tokens == 10
    assert store.stats().entries == 1


# ---- exactness and the pool's documents --------------------------------------------------------


def test_greedy_output_is_the_targets_alone_alone_and_batched(trained):
    prompts = (DOG, CODE, "Once upon a time", "Numbers: 0 1 2")
    expected = _reference(trained, prompts)
    spec = load(trained, speculative_method="suffix")
    assert engine_internals(spec).speculation == "suffix"
    assert isinstance(engine_internals(spec).runner, SuffixRunner)
    alone = [spec.generate(p, max_tokens=TOKENS, temperature=0) for p in prompts]
    assert [r.token_ids for r in alone] == expected
    batched = spec.generate(list(prompts), max_tokens=TOKENS, temperature=0)  # mixed lengths
    assert [r.token_ids for r in batched] == expected
    assert (
        0 < sum(r.usage.accepted_tokens for r in alone) <= sum(r.usage.draft_tokens for r in alone)
    )
    stats = spec.stats().suffix
    assert stats.entries >= len(prompts)  # the prompts and the outputs
    assert spec.stats().pool.in_use == 0


def test_a_pic_prompts_plus_documents_propose_for_later_answers(trained):
    """A span query's plus fragments join the store; a later request whose prompt holds
    none of the text, but whose answer copies it, takes its proposals from there."""
    blocks = [("plus", DOG), ("plus", CODE), ("cross", "Again: The quick")]
    alone = load(trained).generate(blocks=blocks, max_tokens=TOKENS, temperature=0)
    spec = load(trained, speculative_method="suffix", paged_attn_block_size=8)
    pic = spec.generate(blocks=blocks, max_tokens=TOKENS, temperature=0)
    assert pic.token_ids == alone.token_ids
    assert pic.usage.accepted_tokens > 0  # from its own plus documents
    before = spec.stats().suffix
    short = "The quick"
    expected = _reference(trained, (short,))[0]
    result = spec.generate(short, max_tokens=TOKENS, temperature=0)
    assert result.token_ids == expected
    after = spec.stats().suffix
    from_documents = after.accepted_from_documents - before.accepted_from_documents
    assert after.proposed_from_documents > before.proposed_from_documents
    assert 0 < from_documents <= result.usage.accepted_tokens
    metrics = ServerMetrics()
    metrics.watch(lambda: [(None, spec.stats())])
    text = generate_latest(metrics.registry).decode()
    accepted = f"spnl_spec_suffix_accepted_from_documents_total {after.accepted_from_documents}"
    assert accepted in text
    assert f"spnl_spec_suffix_tokens {after.tokens}" in text


def test_a_finished_output_proposes_for_the_next_request(trained):
    spec = load(trained, speculative_method="suffix")
    first = spec.generate("The quick", max_tokens=TOKENS, temperature=0)
    assert tuple(first.token_ids) in spec_store(spec).entries
    again = spec.generate("The quick", max_tokens=TOKENS, temperature=0)
    assert again.token_ids == first.token_ids
    stats = spec.stats().suffix
    assert stats.accepted_from_documents + stats.accepted_from_outputs > 0


def spec_store(spec) -> TokenStore:
    return engine_internals(spec).runner.store


def test_the_store_stays_within_its_budget(trained):
    spec = load(trained, speculative_method="suffix", speculative_suffix_tokens=40)
    for prompt in (DOG, CODE, "Once upon a time"):
        spec.generate(prompt, max_tokens=TOKENS, temperature=0)
    stats = spec.stats().suffix
    assert 0 < stats.tokens <= 40
    assert stats.budget_tokens == 40
    assert stats.dropped_entries > 0


# ---- settings ----------------------------------------------------------------------------------


def test_settings_are_checked(monkeypatch):
    with pytest.raises(SettingsError, match="uses no draft model, but a draft is set"):
        BackendSettings(speculative_method="suffix", speculative_draft_isq="Q8_0")
    with pytest.raises(SettingsError, match="SPECULATIVE_SUFFIX_TOKENS"):
        BackendSettings(speculative_method="suffix", speculative_suffix_tokens=0)
    monkeypatch.setenv("MISTRALRS_SPECULATIVE_METHOD", "suffix")
    monkeypatch.setenv("MISTRALRS_SPECULATIVE_SUFFIX_TOKENS", "4096")
    settings = BackendSettings()
    assert (settings.speculative, settings.speculative_suffix_tokens) == ("suffix", 4096)
    named = "MISTRALRS_SPECULATIVE_SUFFIX_TOKENS"
    assert named not in dict(ineffective_settings(settings, detect_platform(settings)))
    monkeypatch.delenv("MISTRALRS_SPECULATIVE_METHOD")
    unused = BackendSettings(speculative_suffix_tokens=10)
    assert "not suffix" in dict(ineffective_settings(unused, detect_platform(unused)))[named]


def test_a_pic_prompt_batched_with_plain_ones_in_a_small_pool(trained):
    """A PIC prompt and plain prompts of mixed lengths in one batch, in a pool small enough
    to preempt: each gets what it gets alone, with proposals, and every block comes back."""
    blocks = [("plus", DOG), ("plus", CODE), ("cross", "Again: The quick")]
    plain = (DOG, "Once upon a time", CODE)
    alone = load(trained, paged_attn_block_size=8)
    expected = [alone.generate(blocks=blocks, max_tokens=TOKENS, temperature=0).token_ids]
    expected += _reference(trained, plain)
    spec = load(
        trained,
        speculative_method="suffix",
        paged_attn_block_size=8,
        paged_attn_context_len=256,
    )
    prompts = [spec.prompt_ids(blocks=blocks)[0][0], *spec.prompt_ids(list(plain))[0]]
    request = spec.submit(prompts, sampling_params(TOKENS, temperature=0))
    for _ in request.items():
        pass
    assert [seq.output_token_ids for seq in request.seqs] == expected
    assert sum(seq.num_accepted_tokens for seq in request.seqs) > 0
    assert spec.stats().preemptions > 0
    assert spec.stats().pool.in_use == 0
