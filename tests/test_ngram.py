"""N-gram speculation (MISTRALRS_SPECULATIVE_METHOD=ngram): proposals from the sequence's
own prompt and output, verified exactly (greedy output is the target's alone, whatever
shares the batch), a draft length that falls to 0 where proposals fail, and its settings
and per-request option checked."""

import itertools
from functools import cache
from pathlib import Path

import pytest
import torch
from helpers import engine_internals
from test_speculative import chi_square_p_value

from spnl_backend import BackendSettings, RequestError, SettingsError, load_backend
from spnl_backend.engine.ngram import (
    MAX_IDLE_STEPS,
    DraftLength,
    NgramIndex,
    NgramRunner,
    verify_cost,
)
from spnl_backend.engine.verification import verify_sampled
from spnl_backend.request import sampling_params

COPYING = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n",
]
FREE = ["Once upon a time", "Numbers: 0 1 2"]
TOKENS = 32


def load(path: Path, **settings):
    return load_backend(str(path), settings=BackendSettings(device="cpu", **settings))


@cache
def _reference(path: Path, paged: bool, prompts: tuple[str, ...], **options) -> list[list[int]]:
    backend = load(path, paged_attn=paged, speculative_method="none")
    return [
        backend.generate(p, max_tokens=TOKENS, temperature=0, **options).token_ids for p in prompts
    ]


@pytest.fixture(scope="module")
def trained(tiny):
    """Trained on a small corpus: it continues the copying prompts as they go."""
    return tiny.trained().path


# ---- exactness ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("paged", "gamma"), [(True, 1), (True, 16), (False, 4)])
def test_greedy_output_is_the_targets_alone_and_batched(trained, paged, gamma):
    prompts = (*COPYING, *FREE)
    expected = _reference(trained, paged, prompts)
    spec = load(trained, paged_attn=paged, speculative_method="ngram", speculative_gamma=gamma)
    alone = [spec.generate(p, max_tokens=TOKENS, temperature=0) for p in prompts]
    assert [r.token_ids for r in alone] == expected
    batched = spec.generate(list(prompts), max_tokens=TOKENS, temperature=0)
    assert [r.token_ids for r in batched] == expected
    drafted = sum(r.usage.draft_tokens for r in alone)
    accepted = sum(r.usage.accepted_tokens for r in alone)
    assert 0 < accepted <= drafted
    copied = sum(r.usage.accepted_tokens for r in alone[: len(COPYING)])
    assert copied >= len(COPYING) * 4  # the copying prompts come largely from lookups


def test_a_requests_tokens_do_not_depend_on_its_batch(trained):
    """Greedy requests beside sampled ones and ones with speculation off or capped, in
    one engine with a small pool: each greedy one gets what it gets alone."""
    expected = _reference(trained, True, tuple(COPYING))
    spec = load(
        trained,
        speculative_method="ngram",
        paged_attn_block_size=8,
        paged_attn_context_len=512,
    )
    engine = engine_internals(spec)
    greedy = [
        engine.add(spec.tokenizer.encode(p), sampling_params(TOKENS, temperature=0))
        for p in COPYING
    ]
    for i, prompt in enumerate(COPYING + FREE):
        for speculative in (0, 2, None):
            params = sampling_params(TOKENS, temperature=0.9, seed=i, speculative=speculative)
            engine.add(spec.tokenizer.encode(prompt), params)
    while engine.has_unfinished():
        engine.step()
    assert [seq.output_token_ids for seq in greedy] == expected
    stats = spec.stats()
    assert stats.preemptions > 0  # the small pool preempted some, mid-proposal or not
    assert stats.pool.in_use == 0


def test_per_request_speculation_off_and_capped(trained):
    spec = load(trained, speculative_method="ngram", speculative_gamma=8)
    expected = _reference(trained, True, tuple(COPYING[:1]))[0]
    off = spec.generate(COPYING[0], max_tokens=TOKENS, temperature=0, speculative=False)
    capped = spec.generate(COPYING[0], max_tokens=TOKENS, temperature=0, speculative=1)
    assert off.token_ids == capped.token_ids == expected
    assert off.usage.draft_tokens == 0
    steps = TOKENS - 1 - capped.usage.accepted_tokens  # at most one proposal per step
    assert 0 < capped.usage.draft_tokens <= steps


def test_constrained_output_keeps_the_constraint(trained):
    """Proposals the regex refuses are cut before verification; the output is the same."""
    regex = r"(The quick brown fox jumps over the lazy dog\. ){1,3}"
    options = dict(max_tokens=TOKENS, temperature=0, regex=regex)
    alone = load(trained, speculative_method="none").generate(COPYING[0], **options)
    spec = load(trained, speculative_method="ngram")
    result = spec.generate(COPYING[0], **options)
    assert result.token_ids == alone.token_ids
    assert result.usage.accepted_tokens > 0


def test_a_pic_prompt_copies_its_plus_documents_exactly(trained):
    """A PIC sequence's generated tokens (and its drafts) fill its last span in order, so
    it takes proposals from its plus documents and rolls rejected ones back; its output is
    what it is without speculation."""
    blocks = [("plus", COPYING[0]), ("plus", COPYING[1]), ("cross", "Again: The quick")]
    alone = load(trained, paged_attn=True, speculative_method="none").generate(
        blocks=blocks, max_tokens=24, temperature=0
    )
    spec = load(trained, paged_attn=True, speculative_method="ngram", paged_attn_block_size=8)
    result = spec.generate(blocks=blocks, max_tokens=24, temperature=0)
    assert result.token_ids == alone.token_ids
    assert 0 < result.usage.accepted_tokens <= result.usage.draft_tokens
    assert spec.stats().pool.in_use == 0


def test_stop_strings_and_logprobs_behave_as_without(trained):
    options = dict(max_tokens=TOKENS, temperature=0, stop=["lazy"], logprobs=True, top_logprobs=2)
    alone = load(trained, speculative_method="none").generate(COPYING[0], **options)
    result = load(trained, speculative_method="ngram").generate(COPYING[0], **options)
    assert (result.text, result.token_ids, result.finish_reason) == (
        alone.text,
        alone.token_ids,
        alone.finish_reason,
    )
    for got, want in zip(result.logprobs, alone.logprobs, strict=True):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_a_certain_draft_keeps_the_targets_distribution():
    """A proposal is a draft whose distribution is all on its token: accepted with the
    target's probability of it, else drawn from the target's others."""
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 10, generator=generator) * 2, -1)
    proposed = int(p[0].argmax())  # the likeliest: accepted often, rejected often enough
    certain = torch.zeros(10)
    certain[proposed] = 1.0
    counts, samples = [0] * 10, 20_000
    for _ in range(samples):
        _, tokens = verify_sampled([p[0], p[1]], [proposed], [certain], generator)
        counts[tokens[0]] += 1
    assert chi_square_p_value(counts, (p[0] * samples).tolist()) > 1e-3
    uniform = [samples / 10] * 10
    assert chi_square_p_value(counts, uniform) < 1e-9  # the test has power


# ---- adaptivity --------------------------------------------------------------------------------


def test_failing_proposals_fall_to_no_drafts(trained, monkeypatch):
    """Every proposal wrong (a token the target never picks): the draft length falls to 0
    and the sequence then tries one token ever more rarely, with the same output."""
    never = 7
    options = dict(max_tokens=96, temperature=0, logit_bias={never: -100})
    expected = load(trained, speculative_method="none").generate(FREE[0], **options).token_ids
    monkeypatch.setattr(NgramIndex, "lookup", lambda self, tokens, k: [never] * k)
    spec = load(trained, speculative_method="ngram", speculative_gamma=16)
    result = spec.generate(FREE[0], **options)
    assert result.token_ids == expected
    assert result.usage.accepted_tokens == 0
    # single tokens until the estimate falls, then single tries after waits of 1, 2, 4, ...
    assert 0 < result.usage.draft_tokens <= 12


def test_draft_length_follows_acceptance():
    """Short while acceptance is unknown or middling (a few rows cost little more than
    one), long once proposals keep passing, 0 with waits ever longer where they fail."""
    length = DraftLength()
    taken = []
    for _ in range(8):
        taken.append(length.usable(16))
        length.settle(taken[-1], taken[-1])
    assert taken[0] == 1
    assert taken[-1] == 16
    assert taken == sorted(taken)
    length.settle(16, 3)  # a miss after a long run: still long
    assert length.usable(16) == 16
    failing = DraftLength()
    taken = []
    for _ in range(600):
        taken.append(failing.usable(16))
        if taken[-1]:
            failing.settle(taken[-1], 0)
    assert set(taken) == {0, 1}
    tries = [i for i, k in enumerate(taken) if k]
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert gaps[-3:] == [MAX_IDLE_STEPS + 1] * 3  # the wait grew to its bound
    assert gaps == sorted(gaps)
    assert DraftLength(accepted=1.0, tried=1.0).usable(12) == 12  # never past gamma
    assert verify_cost(3) == verify_cost(4) < verify_cost(40)


def test_the_index_proposes_what_followed_the_longest_latest_match():
    index = NgramIndex(min_n=1, max_n=3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 2, 3]
    assert index.lookup(tokens, 3) == [4, 5, 6]  # [7, 2, 3] never occurred; [2, 3] did
    assert index.lookup([*tokens, 4], 2) == [5, 6]  # [2, 3, 4]
    assert NgramIndex(1, 3).lookup([5, 6, 7, 8], 4) == []  # nothing occurred before
    assert NgramIndex(2, 2).lookup([1, 2, 1], 2) == []  # [2, 1] never occurred before


def test_a_repetition_shorter_than_the_draft_is_copied_on_over_itself():
    # [7, 8] last ended 2 tokens back: what followed it runs into the suffix, and the
    # copy goes on with the period (a loop of 2 tokens gives a full draft, not 2 tokens)
    assert NgramIndex(2, 2).lookup([1, 7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]
    assert NgramIndex(1, 1).lookup([3, 5, 5], 4) == [5, 5, 5, 5]
    assert NgramIndex(2, 3).lookup([1, 2, 3, 1, 2], 2) == [3, 1]  # no overlap: as before


# ---- settings and requests ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"speculative_method": "medusa"}, "expected one of: auto, draft, ngram, suffix, none"),
        ({"speculative_method": "draft"}, "needs a draft"),
        (
            {"speculative_method": "ngram", "speculative_draft_isq": "Q8_0"},
            "uses no draft model, but a draft is set",
        ),
        ({"speculative_ngram_min": 5}, "expected 1 <= min <= max <= 64"),
        ({"speculative_ngram_max": 0}, "SPECULATIVE_NGRAM_MAX"),
    ],
)
def test_bad_settings_are_refused_with_what_is_accepted(settings, message):
    with pytest.raises(SettingsError, match=message):
        BackendSettings(**settings)


def test_the_method_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("MISTRALRS_SPECULATIVE_METHOD", "NGRAM")
    monkeypatch.setenv("MISTRALRS_SPECULATIVE_NGRAM_MAX", "6")
    settings = BackendSettings()
    assert (settings.speculative, settings.speculative_ngram_max) == ("ngram", 6)
    monkeypatch.setenv("MISTRALRS_SPECULATIVE_METHOD", "ngrams")
    with pytest.raises(SettingsError, match="MISTRALRS_SPECULATIVE_METHOD='ngrams'"):
        BackendSettings()


def test_the_engine_runs_the_method_chosen(tiny):
    spec = load(tiny.hf("llama").path, speculative_method="ngram")
    assert isinstance(engine_internals(spec).runner, NgramRunner)
    assert engine_internals(spec).speculation == "ngram"
    none = load(tiny.hf("llama").path, speculative_method="none")
    assert engine_internals(none).speculation is None


@pytest.mark.parametrize("value", [-1, 257, 1.5, "yes"])
def test_a_bad_speculative_option_is_refused(value):
    with pytest.raises(RequestError, match=r"speculative=.*: expected true .* or an integer"):
        sampling_params(8, speculative=value)


def test_asking_for_speculation_where_there_is_none_is_refused(tiny):
    backend = load(tiny.hf("llama").path, speculative_method="none")
    with pytest.raises(RequestError, match=r"decodes without speculation \(.*METHOD=none\)"):
        backend.generate("hi", max_tokens=2, speculative=4)
    assert backend.generate("hi", max_tokens=2, speculative=False).usage.draft_tokens == 0


def test_the_server_takes_the_option_per_request():
    from spnl_backend.server.protocol import ApiError, parse_chat, parse_completion

    asked = parse_completion({"model": "m", "prompt": "hi", "speculative": 3})
    assert asked.params.speculative == 3
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "speculative": False}
    assert parse_chat(chat).params.speculative == 0
    with pytest.raises(ApiError) as refused:
        parse_completion({"model": "m", "prompt": "hi", "speculative": "fast"})
    assert refused.value.param == "speculative"
