import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spnl_backend.engine.sampler import sample
from spnl_backend.engine.sequence import SamplingParams

GREEDY = SamplingParams(temperature=0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("nan")]), min_size=1))
def test_greedy_matches_torch_argmax_with_ties_and_nan(values: list[float]) -> None:
    logits = torch.tensor([values, values[::-1]], dtype=torch.float32)
    assert sample(logits, [GREEDY, GREEDY], [None, None]) == logits.argmax(-1).tolist()


def test_greedy_on_a_large_vocabulary() -> None:
    logits = torch.randn(3, 262144, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [GREEDY] * 3, [None] * 3) == logits.argmax(-1).tolist()
