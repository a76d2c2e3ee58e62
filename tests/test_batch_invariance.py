"""A request's greedy tokens do not depend on what shares its steps: batch invariance, on by
default. Random prompt sets, batch splits, thread counts and KV budgets (preempting and
recomputing sequences), with prefix-cache hits from repeated prompts, must give each prompt
the tokens it gets alone. Tiny models here; the default model's 16 prompts in the slow test.
"""

import threading
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spnl_backend import BackendSettings, load_backend

POOL = [
    "The",
    "The quick brown fox",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a fox who",
    "def add(a, b):\n    return a + b",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20",
    " ".join(["A long prompt that spans several KV blocks."] * 6),
    "Lazy dogs",
]
TOKENS = 10
# Quantized products on the int8 path (k-quants and a 32-value format), paged and not.
CASES = {
    "Q4_K": {"isq": "Q4_K"},
    "Q8_0": {"isq": "Q8_0"},
    "Q4_K, not paged": {"isq": "Q4_K", "paged_attn": False},
}
SLOW_SETTINGS = settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def trained(tiny):
    return tiny.trained().path


@cache
def _backend(path: str, case: str, **extra):
    fields = {"device": "cpu", **CASES[case], **extra}
    return load_backend(path, settings=BackendSettings(**fields))


@cache
def _serial(path: str, case: str, prompt: str, tokens: int = TOKENS) -> tuple[int, ...]:
    """The prompt's tokens alone, on a backend that caches no prefix."""
    backend = _backend(path, case, prefix_cache_n=0)
    return tuple(backend.generate(prompt, max_tokens=tokens, temperature=0).token_ids)


def _expected(path, case, prompts, tokens: int = TOKENS):
    return [_serial(path, case, p, tokens) for p in prompts]


def _tokens(results) -> list[tuple[int, ...]]:
    return [tuple(r.token_ids) for r in results]


prompt_sets = st.lists(st.sampled_from(POOL), min_size=2, max_size=8)


@pytest.mark.parametrize("case", list(CASES))
@SLOW_SETTINGS
@given(prompts=prompt_sets, cut=st.integers(1, 7))
def test_a_list_split_anywhere_gives_the_serial_tokens(trained, case, prompts, cut):
    backend = _backend(str(trained), case)
    cut = min(cut, len(prompts) - 1)
    got = _tokens(backend.generate(prompts[:cut], max_tokens=TOKENS, temperature=0))
    got += _tokens(backend.generate(prompts[cut:], max_tokens=TOKENS, temperature=0))
    assert got == _expected(str(trained), case, prompts)


@pytest.mark.parametrize("case", list(CASES))
@SLOW_SETTINGS
@given(prompts=prompt_sets)
def test_threads_give_the_serial_tokens(trained, case, prompts):
    backend = _backend(str(trained), case)
    got: dict[int, tuple[int, ...]] = {}

    def run(i: int) -> None:
        result = backend.generate(prompts[i], max_tokens=TOKENS, temperature=0)
        got[i] = tuple(result.token_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [got[i] for i in range(len(prompts))] == _expected(str(trained), case, prompts)


# Prompts that fit the tight pool, and enough tokens for their growth to overflow it.
FITTING = [p for p in POOL if len(p) < 100]
PREEMPT_TOKENS = 30


@pytest.mark.parametrize("case", ["Q4_K", "Q8_0"])
@SLOW_SETTINGS
@given(prompts=st.lists(st.sampled_from(FITTING), min_size=5, max_size=8))
def test_preemption_and_recompute_give_the_serial_tokens(trained, case, prompts):
    """A pool of 8 blocks: sequences are preempted and their tokens recomputed as a
    prefill, which must give the KV that decoding them gave."""
    backend = _tight(str(trained), case)
    got = _tokens(backend.generate(prompts, max_tokens=PREEMPT_TOKENS, temperature=0))
    assert got == _expected(str(trained), case, prompts, PREEMPT_TOKENS)


def _tight(path: str, case: str):
    return _backend(path, case, paged_attn_context_len=128, paged_attn_block_size=16)


def test_the_tight_budget_does_preempt(trained):
    backend = _tight(str(trained), "Q4_K")
    before = backend.stats().preemptions
    got = _tokens(backend.generate(FITTING, max_tokens=PREEMPT_TOKENS, temperature=0))
    assert backend.stats().preemptions > before
    assert got == _expected(str(trained), "Q4_K", FITTING, PREEMPT_TOKENS)


def test_speculative_decoding_gives_the_serial_tokens(trained):
    backend = _backend(str(trained), "Q4_K", speculative_draft_isq="Q8_0")
    got = _tokens(backend.generate(POOL, max_tokens=TOKENS, temperature=0))
    assert got == _expected(str(trained), "Q4_K", POOL)


def test_a_seeded_request_samples_alike_alone_or_batched(trained):
    """Each sequence draws from its own generator: the rows beside it change nothing."""
    backend = _backend(str(trained), "Q4_K")

    def sampled(prompts):
        results = backend.generate(prompts, max_tokens=TOKENS, temperature=0.9, seed=7)
        return _tokens(results)

    alone = [sampled([prompt])[0] for prompt in POOL[:4]]
    assert sampled(POOL[:4]) == alone
