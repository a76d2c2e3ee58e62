"""Greedy fidelity to llama.cpp and transformers on the default model, against a fixture.

tests/data/fidelity.json holds, for 16 short prompts, 32 greedy tokens of llama.cpp and of
transformers (float32, the GGUF dequantized), each fed the prompt's token ids (the raw
prompt with the BOS our tokenizer adds), and transformers' argmax at each of llama.cpp's
positions when fed llama.cpp's own tokens. ``python bench/fidelity.py --peers-python
PATH`` records it (CI has neither llama.cpp nor the time for transformers); ``--check``
prints the table these tests judge, ``--perturb`` what a rounding error does.

What the measurements say (bench/fidelity.py, 2026-11-25):

- With float32 activations (``MISTRALRS_CPU_MATMUL=float32``) ours computes what
  transformers computes: the same greedy tokens, 512 of 512, and a relative error of
  1e-7 in the embeddings moves none of them.
- With int8 activations (the default, as llama.cpp's), greedy text is chaotic: the
  rounding of each activation to 8 bits turns an error of 1e-7 into a different rounding
  somewhere, and that, layers later, into a logit error of the size of the rounding itself
  (RMS 0.21 over these positions, as large as ours against llama.cpp). Ours against itself
  so perturbed keeps 306-353 of 512 greedy tokens, fewer than it shares with llama.cpp
  (328). How long two int8 engines agree is a matter of where near-ties fall, unless every
  float operation of one is the other's.
- Token by token (teacher-forced, without the cascade a first divergence sets off) ours
  picks llama.cpp's token at 495 of its 512 positions, transformers at 501.

So the tests check what can be promised: the exact path reproduces transformers; the
default path agrees with llama.cpp token by token nearly as often as exact arithmetic;
and the greedy common-prefix criterion of the issue stays an expected failure, strict, so
that it is looked at again should it ever pass.
"""

import json
import sys
from pathlib import Path

import pytest

from spnl_backend import load_backend
from spnl_backend.settings import load_settings

# The bench scripts import their siblings (`harness`) as top-level modules, as they do
# when run as `python bench/fidelity.py`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench.fidelity import FIXTURE, agreeing, common_prefix, sha256, teacher_forced

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def default_backend():
    backend = load_backend()  # the default model, default settings
    yield backend
    backend.close()


def test_fixture_is_of_the_default_model(fixture, default_backend):
    path = default_backend.source.path
    assert path.stat().st_size == fixture["gguf"]["bytes"], fixture["gguf"]
    assert sha256(path) == fixture["gguf"]["sha256"], fixture["gguf"]
    assert len(fixture["prompts"]) >= 8
    for case in fixture["prompts"]:
        assert default_backend.tokenizer.encode(case["prompt"]) == case["prompt_ids"]
        assert len(case["llama_cpp"]) == len(case["transformers"]) == 32
        assert len(case["transformers_on_llama_cpp"]) == len(case["llama_cpp"])


def test_float32_activations_give_transformers_greedy_tokens(fixture):
    """The exact path: every greedy token of transformers' float32 run of the same file."""
    backend = load_backend(settings=load_settings(cpu_matmul="float32"))
    try:
        for case in fixture["prompts"]:
            hf = case["transformers"]
            ours = backend.generate(case["prompt"], max_tokens=len(hf), temperature=0)
            assert ours.token_ids == hf, case["prompt"]
    finally:
        backend.close()


def test_token_by_token_ours_picks_llama_cpps_token_nearly_as_often_as_transformers(
    fixture, default_backend
):
    """Fed llama.cpp's own tokens, ours (int8 activations, an independent rounding of the
    same arithmetic) may pick another token only where transformers nearly does: at most
    3% of the positions fewer than transformers' agreement (measured: 495 against 501)."""
    cases = fixture["prompts"]
    ours = sum(agreeing(teacher_forced(default_backend, c), c["llama_cpp"]) for c in cases)
    hf = sum(agreeing(c["transformers_on_llama_cpp"], c["llama_cpp"]) for c in cases)
    positions = sum(len(c["llama_cpp"]) for c in cases)
    assert ours >= hf - 0.03 * positions, (ours, hf, positions)


@pytest.mark.xfail(
    strict=True,
    reason="int8 activations make greedy text chaotic (see the module's docstring): ours "
    "agrees with llama.cpp for 320 of 512 greedy tokens (float16 KV cache; 328 with "
    "float32), transformers for 382, ours with a 1e-7 relative error against itself "
    "for 306-353. Strict: should it pass, look again and remove the mark.",
)
def test_greedy_agrees_with_llama_cpp_at_least_as_long_as_transformers(fixture, default_backend):
    rows = []
    for case in fixture["prompts"]:
        llama = case["llama_cpp"]
        ours = default_backend.generate(
            case["prompt"], max_tokens=len(llama), temperature=0
        ).token_ids
        rows.append(
            (case["prompt"], common_prefix(ours, llama), common_prefix(case["transformers"], llama))
        )
    table = "\n".join(f"{ours:3} {hf:3}  {prompt!r}" for prompt, ours, hf in rows)
    table = f"ours~llama.cpp, transformers~llama.cpp, prompt:\n{table}"
    ours_total, hf_total = sum(row[1] for row in rows), sum(row[2] for row in rows)
    below_floor = [prompt for prompt, ours, hf in rows if ours < hf // 2]
    summary = (
        f"total {ours_total} against transformers' {hf_total}; below half of "
        f"transformers' agreement: {below_floor}\n{table}"
    )
    assert ours_total >= hf_total, summary
    assert not below_floor, summary
