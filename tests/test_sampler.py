import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spnl_backend.engine.sampler import distribution, sample
from spnl_backend.errors import EngineError
from spnl_backend.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("nan")]), min_size=1))
def test_greedy_matches_torch_argmax_with_ties_and_fails_a_nan_row(values: list[float]) -> None:
    logits = torch.tensor([values, values[::-1]], dtype=torch.float32)
    chosen = sample(logits, [GREEDY, GREEDY], [None, None])
    if any(math.isnan(v) for v in values):
        assert all(isinstance(c, EngineError) and "NaN" in str(c) for c in chosen)
    else:
        assert chosen == logits.argmax(-1).tolist()


def test_greedy_on_a_large_vocabulary() -> None:
    logits = torch.randn(3, 262144, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [GREEDY] * 3, [None] * 3) == logits.argmax(-1).tolist()


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    params = [SamplingParams(temperature=1.0)] * 3
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    chosen = sample(logits, params, generators)
    assert isinstance(chosen[1], EngineError)
    assert all(isinstance(c, int) for c in (chosen[0], chosen[2]))


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-300, 1e-38])
def test_a_vanishing_temperature_is_the_limit_of_the_distribution(temperature) -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, -2.0, 2.999999])
    probs = distribution(logits, SamplingParams(temperature=temperature))
    assert torch.isfinite(probs).all()
    assert probs.tolist() == [0.0, 0.5, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_vanishing_top_p_keeps_the_largest_logit(top_p) -> None:
    logits = torch.tensor([1.0, 3.0, 2.0])
    probs = distribution(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_huge_temperatures_flatten_the_distribution() -> None:
    logits = torch.tensor([1.0, 30.0, -20.0])
    probs = distribution(logits, SamplingParams(temperature=1e308))
    torch.testing.assert_close(probs, torch.full((3,), 1 / 3))
