"""Speculative decoding: exactly the target's output, with paged caches, prefix hits,
batches and preemption; rejected drafts rolled back; bad pairs refused at load."""

import json
import math
import random
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
from helpers import engine_internals, model_logits
from tiny_models import build_hf_model

from spnl_backend import (
    BackendSettings,
    ModelFileError,
    ModelNotFoundError,
    SettingsError,
    load_backend,
)
from spnl_backend.engine.sampler import distribution
from spnl_backend.engine.verification import verify_sampled
from spnl_backend.sampling import SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
    "hello world",
]
TOKENS = 24


@pytest.fixture(scope="session")
def pair(tmp_path_factory, tiny):
    """A target and an unrelated draft of the same vocabulary (so drafts are often
    rejected)."""
    root = tmp_path_factory.mktemp("speculative")
    draft = build_hf_model("llama", root / "draft", seed=1).path
    return tiny.hf("llama").path, draft


def load(target: Path, **settings):
    return load_backend(str(target), settings=BackendSettings(device="cpu", **settings))


@cache
def _reference(target: Path, prompts: tuple[str, ...], paged: bool) -> list[list[int]]:
    backend = load(target, paged_attn=paged)
    return [backend.generate(p, max_tokens=TOKENS, temperature=0).token_ids for p in prompts]


def draft_settings(pair, kind: str) -> dict:
    if kind == "other model":
        return {"speculative_draft_model": str(pair[1])}
    return {"speculative_draft_isq": "Q8_0"}  # the target itself, quantized


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("draft", ["other model", "self Q8_0"])
@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_output_is_the_targets_alone_and_batched(pair, paged, draft, gamma):
    expected = _reference(pair[0], tuple(PROMPTS), paged)
    spec = load(pair[0], paged_attn=paged, speculative_gamma=gamma, **draft_settings(pair, draft))
    alone = [spec.generate(p, max_tokens=TOKENS, temperature=0) for p in PROMPTS]
    assert [r.token_ids for r in alone] == expected
    batched = spec.generate(PROMPTS, max_tokens=TOKENS, temperature=0)
    assert [r.token_ids for r in batched] == expected
    drafted = sum(r.usage.draft_tokens for r in alone)
    accepted = sum(r.usage.accepted_tokens for r in alone)
    assert drafted > 0
    assert 0 <= accepted <= drafted
    if draft == "self Q8_0":
        assert accepted > drafted / 2  # a faithful draft is mostly right


@pytest.mark.parametrize("paged", [True, False])
def test_the_inspection_api_describes_the_targets_cache(pair, paged):
    settings = dict(paged_attn=paged, paged_attn_block_size=8, paged_attn_context_len=256)
    alone = load(pair[0], **settings)
    spec = load(pair[0], **settings, **draft_settings(pair, "other model"))
    assert spec.cache_info() == alone.cache_info()
    assert torch.equal(*(next(b.model.parameters()) for b in (spec, alone)))  # not the draft
    result = spec.generate(PROMPTS[0], max_tokens=8, temperature=0)
    stats = spec.stats()
    assert stats.prefix_cache_queries == result.usage.prompt_tokens
    assert (stats.pool is None) == (not paged)


def test_usage_counts_nothing_without_a_draft(tiny):
    result = load(tiny.hf("llama").path).generate(PROMPTS[0], max_tokens=4, temperature=0)
    assert (result.usage.draft_tokens, result.usage.accepted_tokens) == (0, 0)


@pytest.mark.parametrize("paged", [True, False])
def test_prefix_cache_hits_in_both_models(pair, paged):
    expected = _reference(pair[0], (PROMPTS[0] * 3,), paged)[0]
    spec = load(
        pair[0],
        paged_attn=paged,
        paged_attn_block_size=8,
        speculative_gamma=3,
        **draft_settings(pair, "other model"),
    )
    draft_cache = engine_internals(spec).cache.draft
    admitted = []
    original = draft_cache.admit

    def spy(view):
        original(view)
        admitted.append(view.num_computed_tokens)

    draft_cache.admit = spy
    first = spec.generate(PROMPTS[0] * 3, max_tokens=TOKENS, temperature=0)
    second = spec.generate(PROMPTS[0] * 3, max_tokens=TOKENS, temperature=0)
    assert first.token_ids == second.token_ids == expected
    assert first.usage.cached_tokens == 0 < second.usage.cached_tokens
    assert admitted[0] == 0 < admitted[1]  # the draft reused its own cached prefix too


def test_preemption_under_a_tight_budget_keeps_the_output(pair):
    prompts = [p * 2 for p in PROMPTS]
    expected = _reference(pair[0], tuple(prompts), True)
    longest = max(len(load(pair[0]).tokenizer.encode(p)) for p in prompts) + TOKENS
    spec = load(
        pair[0],
        paged_attn=True,
        paged_attn_block_size=8,
        paged_attn_context_len=-(-(longest + 16) // 8) * 8,  # whole blocks of 8
        speculative_gamma=4,
        **draft_settings(pair, "other model"),
    )
    results = spec.generate(prompts, max_tokens=TOKENS, temperature=0)
    assert [r.token_ids for r in results] == expected
    stats = spec.stats()
    assert stats.preemptions > 0
    assert stats.pool.in_use == 0  # the target's blocks all came back; the draft's:
    draft_blocks = engine_internals(spec).cache.draft.blocks
    assert draft_blocks.num_available == draft_blocks.num_blocks


def test_rejected_drafts_leak_no_blocks_over_a_thousand_steps(pair):
    spec = load(
        pair[0],
        paged_attn=True,
        paged_attn_block_size=8,
        speculative_gamma=3,
        **draft_settings(pair, "other model"),
    )
    engine = engine_internals(spec)
    cache = engine.cache
    rng = random.Random(0)
    ids = [spec.tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=rng.randint(5, 40), temperature=t) for t in (0.0, 0.8)]
    seqs = []
    for _ in range(1000):
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < 3:
            seqs.append(engine.add(rng.choice(ids), rng.choice(params)))
        engine.step()
        for seq in engine.scheduler.running:
            if seq.num_computed_tokens + 1 == seq.num_tokens:  # between decode steps
                table = cache.target.tables[seq.seq_id].block_ids
                assert len(table) == cache.target.blocks.blocks_for(seq.num_computed_tokens)
            view = cache.views.get(seq.seq_id)
            if view is not None:
                held = len(cache.draft.tables[seq.seq_id].block_ids)
                assert held == cache.draft.blocks.blocks_for(view.num_computed_tokens)
        for manager in (cache.target, cache.draft):
            _check_accounting(manager.blocks, manager.tables)
    assert sum(s.num_draft_tokens - s.num_accepted_tokens for s in seqs) > 100  # rejections
    while engine.has_unfinished():
        engine.step()
    for blocks in (cache.target.blocks, cache.draft.blocks):
        assert blocks.num_available == blocks.num_blocks


def _check_accounting(blocks, tables) -> None:
    referenced: dict[int, int] = {}
    for table in tables.values():
        for block_id in table.block_ids:
            referenced[block_id] = referenced.get(block_id, 0) + 1
    for block in blocks.blocks:
        assert block.ref_count == referenced.get(block.block_id, 0)
    assert len(referenced) + blocks.num_available == blocks.num_blocks


# ---- the output distribution is the target's ------------------------------------------------


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Upper tail of Pearson's statistic (Wilson-Hilferty: accurate to ~1e-3 here)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = len(observed) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_rule_samples_the_target_distribution():
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 12, generator=generator) * 2, -1)
    q = torch.softmax(torch.randn(2, 12, generator=generator) * 2, -1)
    counts = [0] * 12
    samples = 20_000
    for _ in range(samples):
        drafts = [int(torch.multinomial(q[0], 1, generator=generator))]
        _, tokens = verify_sampled([p[0], p[1]], drafts, [q[0]], generator)
        counts[tokens[0]] += 1
    assert chi_square_p_value(counts, (p[0] * samples).tolist()) > 1e-3
    assert chi_square_p_value(counts, (q[0] * samples).tolist()) < 1e-9  # the test has power


def test_sampled_tokens_follow_the_targets_distribution(pair):
    """Tokens 2 and 3 come from speculative steps (token 1 from the prompt's pass); their
    counts given the tokens before them match the target's own probabilities."""
    spec = load(pair[0], speculative_gamma=2, **draft_settings(pair, "other model"))
    params = dict(max_tokens=3, temperature=1.0, top_k=6)
    prompt = spec.tokenizer.encode(PROMPTS[0])
    engine = engine_internals(spec)
    seqs = [engine.add(prompt, SamplingParams(**params, seed=i)) for i in range(3000)]
    while engine.has_unfinished():
        engine.step()
    assert sum(s.num_draft_tokens for s in seqs) > 0
    assert sum(s.num_accepted_tokens for s in seqs) < sum(s.num_draft_tokens for s in seqs)
    target = load(pair[0])
    sampling = SamplingParams(**params)
    for position in (1, 2):
        observed, expected = conditional_counts(target, prompt, seqs, position, sampling)
        assert chi_square_p_value(observed, expected) > 1e-3


def conditional_counts(target, prompt, seqs, position, sampling):
    """Pooled cells (context, token): observed counts, and the count the target's own
    distribution given that context predicts (cells expecting under 5 are merged)."""
    by_context: dict[tuple[int, ...], list[int]] = {}
    for seq in seqs:
        by_context.setdefault(tuple(seq.output_token_ids[:position]), []).append(
            seq.output_token_ids[position]
        )
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for context, tokens in by_context.items():
        logits = model_logits(target, prompt + list(context))[-1]
        probs = distribution(logits, sampling)
        for token in range(probs.shape[0]):
            e = float(probs[token]) * len(tokens)
            o = tokens.count(token)
            if e >= 5:
                observed.append(o)
                expected.append(e)
            else:
                rest_o, rest_e = rest_o + o, rest_e + e
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    return observed, expected


# ---- bad pairs --------------------------------------------------------------------------------


def test_a_draft_with_another_vocabulary_is_refused(pair, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(pair[1], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    renamed = next(t for t, i in vocab.items() if i == 100)
    vocab["zzzz-not-a-token"] = vocab.pop(renamed)
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(
        SettingsError, match=r"token id 100 is .* in the target and 'zzzz-not-a-token'"
    ):
        load(pair[0], speculative_draft_model=str(other))


def test_gamma_zero_is_refused(monkeypatch):
    monkeypatch.setenv("MISTRALRS_SPECULATIVE_GAMMA", "0")
    with pytest.raises(SettingsError, match="MISTRALRS_SPECULATIVE_GAMMA='0'"):
        BackendSettings()


def test_a_missing_draft_names_the_draft(pair, tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"speculative draft .*no-such-draft"):
        load(pair[0], speculative_draft_model=str(tmp_path / "no-such-draft"))


def test_a_broken_draft_names_the_draft(pair, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 12)
    with pytest.raises(ModelFileError, match="speculative draft"):
        load(pair[0], speculative_draft_model=str(broken))


def test_gamma_without_speculation_is_reported(tiny, monkeypatch, caplog):
    """Without a draft, auto runs n-gram speculation, which the gamma bounds: only with
    MISTRALRS_SPECULATIVE_METHOD=none does it change nothing."""
    monkeypatch.setenv("MISTRALRS_SPECULATIVE_GAMMA", "4")
    monkeypatch.setenv("MISTRALRS_SPECULATIVE_METHOD", "none")
    monkeypatch.setenv("MISTRALRS_DEVICE", "cpu")
    with caplog.at_level("WARNING", logger="spnl_backend"):
        load_backend(str(tiny.hf("llama").path))
    assert "settings.no_effect" in caplog.text
    assert "MISTRALRS_SPECULATIVE_GAMMA" in caplog.text
