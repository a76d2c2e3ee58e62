"""Suffix speculation (MISTRALRS_SPECULATIVE_METHOD=suffix): n-gram proposals from the
sequence's own tokens, else from a store the requests share (prompts' documents, a PIC
prompt's plus elements one by one, and finished outputs), bounded by a token budget;
verified exactly, so greedy output is the target's alone."""

from functools import cache
from pathlib import Path

import pytest
from helpers import engine_internals
from live_server import MODEL
from prometheus_client import generate_latest
from test_speculative import chi_square_p_value, conditional_counts

from spnl_backend import BackendSettings, SettingsError, load_backend
from spnl_backend.engine.ngram import DraftLength, NgramIndex
from spnl_backend.engine.suffix import SuffixRunner, TokenStore
from spnl_backend.request import sampling_params
from spnl_backend.results import read_results
from spnl_backend.sampling import SamplingParams
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


# ---- exactness under every request option ------------------------------------------------------


class Recorded:
    """The proposals a runner made, step by step: (what it guessed, what went to
    verification) per sequence id."""

    def __init__(self, runner: SuffixRunner, monkeypatch) -> None:
        self.steps: list[dict[int, list[int]]] = []
        self.cuts: list[tuple[list[int], list[int]]] = []
        propose, proposal = runner._propose, runner._proposal

        def recorded_propose(batch):
            made = propose(batch)
            self.steps.append({seq_id: list(p.tokens) for seq_id, p in made.items()})
            return made

        def recorded_proposal(seq, guess):
            made = proposal(seq, guess)
            self.cuts.append((list(guess), list(made.tokens)))
            return made

        monkeypatch.setattr(runner, "_propose", recorded_propose)
        monkeypatch.setattr(runner, "_proposal", recorded_proposal)


def test_sampled_tokens_follow_the_targets_distribution(trained):
    """Tokens 2 and 3 come from verified proposals (the prompt's next words, which a hot
    temperature makes the target keep about three times in four); their counts given the
    tokens before them match the target's own probabilities."""
    spec = load(trained, speculative_method="suffix")
    params = dict(max_tokens=3, temperature=3.0, top_k=6)
    prompt = spec.tokenizer.encode(DOG[: DOG.rindex(" lazy")])  # "... jumps over the"
    engine = engine_internals(spec)
    seqs = [engine.add(prompt, SamplingParams(**params, seed=i)) for i in range(3000)]
    while engine.has_unfinished():
        engine.step()
    drafted = sum(s.num_draft_tokens for s in seqs)
    accepted = sum(s.num_accepted_tokens for s in seqs)
    assert drafted > 1000  # most sequences' second token went through verification
    assert drafted // 10 < accepted < drafted - drafted // 10  # both outcomes, often
    target = load(trained)
    sampling = SamplingParams(**params)
    for position in (1, 2):
        observed, expected = conditional_counts(target, prompt, seqs, position, sampling)
        assert chi_square_p_value(observed, expected) > 1e-3


def test_proposals_the_grammar_refuses_are_cut_before_verification(trained, monkeypatch):
    """The regex allows the passage with another last word: the store proposes the
    prompt's word, the constraint cuts it off, and the output is what it is without
    speculation."""
    regex = r"(The quick brown fox jumps over the lazy cat\. ){1,3}"
    options = dict(max_tokens=64, temperature=0, regex=regex)  # past the first "lazy"
    alone = load(trained).generate(DOG, **options)
    spec = load(trained, speculative_method="suffix")
    recorded = Recorded(engine_internals(spec).runner, monkeypatch)
    result = spec.generate(DOG, **options)
    assert result.token_ids == alone.token_ids
    assert result.usage.accepted_tokens > 0
    cut = [(guess, kept) for guess, kept in recorded.cuts if len(kept) < len(guess)]
    assert cut  # some proposal went to verification shorter than guessed
    assert all(guess[: len(kept)] == kept for guess, kept in cut)
    assert spec.tokenizer.decode(result.token_ids).count("dog") == 0


def test_stop_strings_logprobs_and_n_behave_as_without(trained):
    """Three greedy completions of one prompt, stopped at a string, with logprobs: each
    as without speculation, with proposals verified for each."""
    params = sampling_params(TOKENS, temperature=0, stop=["lazy"], logprobs=True, top_logprobs=2)
    alone = load(trained)
    expected = read_results(alone.submit(alone.prompt_ids(CODE + DOG)[0], params, n=3), False)
    spec = load(trained, speculative_method="suffix")
    results = read_results(spec.submit(spec.prompt_ids(CODE + DOG)[0], params, n=3), False)
    assert len(results) == 3
    for got, want in zip(results, expected, strict=True):
        assert (got.text, got.token_ids, got.finish_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
        )
        assert got.finish_reason == "stop"
        for mine, theirs in zip(got.logprobs, want.logprobs, strict=True):
            assert mine.token_id == theirs.token_id
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    assert all(r.usage.accepted_tokens > 0 for r in results)


def test_one_step_verifies_proposals_of_mixed_lengths(trained, monkeypatch):
    """Sequences with their own caps (none, 1, 3, off) decode in one batch, each proposing
    as many tokens as it may (rejections included): a step holds proposals of different
    lengths, and each output is what it is alone."""
    prompts = (DOG, CODE, DOG, CODE)
    expected = _reference(trained, prompts)
    monkeypatch.setattr(DraftLength, "usable", lambda self, gamma: gamma)
    spec = load(trained, speculative_method="suffix")
    engine = engine_internals(spec)
    recorded = Recorded(engine.runner, monkeypatch)
    caps = (None, 1, 3, 0)
    seqs = [
        engine.add(spec.tokenizer.encode(p), sampling_params(TOKENS, temperature=0, speculative=c))
        for p, c in zip(prompts, caps, strict=True)
    ]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs] == expected
    mixed = [step for step in recorded.steps if len({len(t) for t in step.values()}) > 1]
    assert mixed  # one step verified proposals of more than one length
    capped = {seqs[1].seq_id: 1, seqs[2].seq_id: 3}
    for step in recorded.steps:
        assert seqs[3].seq_id not in step  # speculation off: never proposed
        assert all(len(step[i]) <= cap for i, cap in capped.items() if i in step)
    assert seqs[3].num_draft_tokens == 0
    assert all(s.num_accepted_tokens > 0 for s in seqs[:3])


def test_a_sequence_preempted_between_verifications_goes_on_exactly(trained):
    """Preempted right after a step that verified its proposals (its accepted drafts' K/V
    computed, its draft length grown), it recomputes from its tokens and proposes again;
    its output is what it is alone and every block comes back."""
    expected = _reference(trained, (DOG, CODE))
    spec = load(trained, speculative_method="suffix", paged_attn_block_size=8)
    engine = engine_internals(spec)
    seqs = [
        engine.add(spec.tokenizer.encode(p), sampling_params(TOKENS, temperature=0))
        for p in (DOG, CODE)
    ]
    preempted = set()
    while engine.has_unfinished():
        engine.step()
        for seq in list(engine.scheduler.running):
            drafted = seq.num_draft_tokens > 0
            if drafted and seq.seq_id not in preempted and len(seq.output_token_ids) < TOKENS - 4:
                engine.scheduler.preempt(seq)
                preempted.add(seq.seq_id)
    assert preempted == {s.seq_id for s in seqs}
    assert [s.output_token_ids for s in seqs] == expected
    drafted_after = [s.num_draft_tokens for s in seqs]
    assert all(d > 0 for d in drafted_after)
    assert spec.stats().preemptions == 2
    assert spec.stats().pool.in_use == 0


# ---- adaptivity --------------------------------------------------------------------------------


def test_store_proposals_that_fail_fall_to_no_drafts(trained, monkeypatch):
    """Text whose store proposals all fail (a token the target never picks) and which
    copies nothing of its own: the draft length falls to 0, and the sequence then tries
    one token ever more rarely, with the same output."""
    never = 7
    options = dict(max_tokens=96, temperature=0, logit_bias={never: -100})
    expected = load(trained).generate("Once upon a time", **options).token_ids
    monkeypatch.setattr(NgramIndex, "lookup", lambda self, tokens, k: [])
    monkeypatch.setattr(TokenStore, "lookup", lambda self, tokens, k: ([never] * k, "document"))
    spec = load(trained, speculative_method="suffix", speculative_gamma=16)
    result = spec.generate("Once upon a time", **options)
    assert result.token_ids == expected
    assert result.usage.accepted_tokens == 0
    # single tokens until the estimate falls, then single tries after waits of 1, 2, 4, ...
    assert 0 < result.usage.draft_tokens <= 12
    stats = spec.stats().suffix
    assert (stats.proposed_from_documents, stats.accepted_from_documents) == (
        result.usage.draft_tokens,
        0,
    )


# ---- the server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(trained):
    spec = load(trained, speculative_method="suffix")
    yield spec
    spec.close()


def test_the_server_reports_proposals_in_usage(live, backend):
    """A completion's usage counts the proposed tokens kept and refused (OpenAI's
    prediction fields); a request that asks for no speculation has none, and the same text."""
    body = {"model": MODEL, "prompt": DOG, "max_tokens": TOKENS, "temperature": 0}
    spec = live.post("/v1/completions", body)
    plain = live.post("/v1/completions", {**body, "speculative": False})
    assert spec.status_code == plain.status_code == 200, spec.text + plain.text
    details = spec.json()["usage"]["completion_tokens_details"]
    accepted, rejected = (
        details["accepted_prediction_tokens"],
        details["rejected_prediction_tokens"],
    )
    assert 0 < accepted < spec.json()["usage"]["completion_tokens"]
    assert rejected >= 0
    assert plain.json()["usage"]["completion_tokens_details"] == {
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    }
    assert spec.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
