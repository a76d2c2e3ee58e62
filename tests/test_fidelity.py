"""Greedy fidelity to llama.cpp on the default model, against a recorded fixture.

tests/data/fidelity.json holds, for 16 short prompts, 32 greedy tokens of llama.cpp and of
transformers (float32, the GGUF dequantized), each fed the prompt's token ids (the raw
prompt with the BOS our tokenizer adds). ``python bench/fidelity.py --peers-python PATH``
records it (CI has neither llama.cpp nor the time for transformers); ``--check`` prints
the table this test judges.

The criterion, with ``ours`` and ``hf`` each prompt's common-prefix length with llama.cpp
(how many leading greedy tokens agree):

- in total over the prompts, ours agrees with llama.cpp at least as long as transformers:
  ``sum(ours) >= sum(hf)``;
- and on every prompt, at least half as long: ``ours >= hf // 2``.

Not ``ours >= hf`` on every prompt: greedy decoding on a 270M model meets near-ties, which
any change of arithmetic (llama.cpp's int8 activations, ours, transformers' float32) may
flip, a few tokens earlier or later; on the fixture of 2026-11-23 transformers agrees with
llama.cpp for only 2 to 19 tokens on 6 prompts, and ours with int8 activations has beaten
it (32 against 15) on one. The total keeps the comparison of the whole, the floor catches
a prompt that goes wrong on its own.
"""

import json
import sys
from pathlib import Path

import pytest

from spnl_backend import load_backend

# The bench scripts import their siblings (`harness`) as top-level modules, as they do
# when run as `python bench/fidelity.py`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench.fidelity import FIXTURE, common_prefix, sha256

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


@pytest.mark.xfail(
    strict=True,
    reason="not met yet (issue 19): with int8 activations ours agrees with llama.cpp for "
    "328 of 512 tokens against transformers' 382 (2026-11-23, each block's integer sum "
    "added in one float; 294 when lanes were added apart); the torch twin with the same "
    "activation rounding gave 281, with blocks of 32 for every type 329, with float32 "
    "activations 382. Strict: when it passes, this mark must go.",
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
