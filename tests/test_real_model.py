"""The embedded default model (Gemma 3 270M, GGUF Q4_K_M) against transformers on the same file."""

import pytest
import torch

from spnl_backend import load_backend

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time"]
TOKENS = 24


@pytest.fixture(scope="module")
def default_backend():
    return load_backend()


def test_greedy_output_equals_transformers_on_the_same_gguf(default_backend):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_backend.source.path
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = reference.generate(ids, max_new_tokens=TOKENS, do_sample=False)
        result = default_backend.generate(prompt, max_tokens=TOKENS, temperature=0)
        assert default_backend.tokenizer.encode(prompt) == ids[0].tolist()
        assert result.token_ids == expected[0, ids.shape[1] :].tolist(), prompt


def test_default_model_completes_coherently(default_backend):
    result = default_backend.generate("The capital of France is", max_tokens=12, temperature=0)
    assert "France" in result.text or "Paris" in result.text
    assert result.usage.prompt_tokens == 6
    assert result.usage.completion_tokens == 12
    assert result.finish_reason == "length"
