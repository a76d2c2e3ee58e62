"""Requests built from anything a caller might pass: each either works or raises the
library's own `RequestError`, and a healthy request running beside it is unchanged.

CI runs a fixed budget of derandomized examples; ``python bench/fuzz_requests.py`` runs the
same properties with many more, randomly (``SPNL_FUZZ_EXAMPLES``).
"""

import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from spnl_backend import BackendSettings, RequestError, SpnlError, load_backend

EXAMPLES = int(os.environ.get("SPNL_FUZZ_EXAMPLES", "0"))
CI = settings(
    max_examples=EXAMPLES or 50,
    deadline=None,
    derandomize=not EXAMPLES,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
HEALTHY = "The capital of France is"

# Text with everything Unicode has, lone surrogates included.
ANY_TEXT = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=24)
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**64, 2**64 - 1, -(2**63), 10**400, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([5e-324, 1e-45, 1e-300, 1e308, -0.0]),
    ANY_TEXT,
    st.binary(max_size=8),
    st.lists(ANY_TEXT, max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.complex_numbers(max_magnitude=10),
    st.decimals(allow_nan=True),
    st.fractions(),
)
SAMPLING = {
    # Valid lengths stay short, so an example that works runs in milliseconds.
    "max_tokens": st.one_of(st.integers(1, 4), st.integers(max_value=-1), ODD),
    "temperature": st.one_of(st.floats(0, 3), ODD),
    "top_p": st.one_of(st.floats(0, 1.5), ODD),
    "top_k": st.one_of(st.integers(-3, 50), ODD),
    "seed": st.one_of(st.integers(-5, 2**65), ODD),
    "stop": st.one_of(ANY_TEXT, st.lists(ANY_TEXT, max_size=3), ODD),
}
REQUESTS = st.fixed_dictionaries({}, optional=SAMPLING)


@pytest.fixture(scope="module")
def backend(tiny):
    settings = BackendSettings(device="cpu", paged_attn=True, paged_attn_context_len=256)
    return load_backend(str(tiny.hf("qwen3").path), settings=settings)


@pytest.fixture(scope="module")
def healthy(backend):
    return backend.generate(HEALTHY, max_tokens=16, temperature=0).text


def _bounded(request: dict) -> dict:
    """``max_tokens`` that would run to the end of the context is capped to keep runs short
    (a None or 0 is still exercised by the Backend tests)."""
    value = request.get("max_tokens")
    if value is None or (type(value) is int and value == 0):  # an odd value may not compare
        request["max_tokens"] = 3
    return request


def _with_a_healthy_stream_beside(backend, healthy, call):
    """Run ``call`` while a greedy stream is mid-flight; the stream must be unchanged."""
    stream = backend.stream(HEALTHY, max_tokens=16, temperature=0)
    text = next(stream)
    try:
        call()
    except RequestError:
        pass
    except SpnlError as exc:  # the library's own, but not the validation error it should be
        pytest.fail(f"{type(exc).__name__} instead of RequestError: {exc}")
    assert text + "".join(stream) == healthy
    stats = backend.stats()
    assert (stats.running, stats.waiting, stats.pool.in_use) == (0, 0, 0)


@CI
@given(request=REQUESTS)
@example(request={"temperature": 1e-45, "seed": 1})  # each of these once crashed or
@example(request={"top_p": 1e-300, "temperature": 1.0})  # raised from deep inside
@example(request={"seed": 2**70})
@example(request={"seed": -1})
@example(request={"stop": 5})
@example(request={"stop": "\ud800"})
@example(request={"temperature": 10**400})
def test_generate_with_any_parameters(backend, healthy, request):
    request = _bounded(request)
    _with_a_healthy_stream_beside(backend, healthy, lambda: backend.generate("hi", **request))


@CI
@given(prompt=st.one_of(ANY_TEXT, st.lists(ANY_TEXT, max_size=3), ODD))
@example(prompt="a lone \udc80 surrogate")
def test_generate_with_any_prompt(backend, healthy, prompt):
    _with_a_healthy_stream_beside(
        backend, healthy, lambda: backend.generate(prompt, max_tokens=2, temperature=0)
    )


@CI
@given(
    messages=st.one_of(
        st.lists(st.fixed_dictionaries({"role": st.one_of(ANY_TEXT, ODD), "content": ANY_TEXT})),
        ODD,
    ),
    request=REQUESTS,
)
def test_chat_with_any_messages(backend, healthy, messages, request):
    request = _bounded(request)
    # The tiny model has no chat template: valid messages end in that RequestError too.
    _with_a_healthy_stream_beside(backend, healthy, lambda: backend.chat(messages, **request))


@CI
@given(request=REQUESTS, unknown=st.text(min_size=1, max_size=12))
def test_stream_with_any_parameters(backend, healthy, request, unknown):
    request = _bounded(request)
    if unknown.isidentifier() and unknown not in SAMPLING:
        request[unknown] = 1

    def call():
        for _ in backend.stream("hi", **request):
            pass

    _with_a_healthy_stream_beside(backend, healthy, call)
