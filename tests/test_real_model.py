"""The embedded default model (Gemma 3 270M, GGUF Q4_K_M) against transformers on the same file."""

import pytest
import torch

from spnl_backend import BackendSettings, load_backend
from spnl_backend.quant.linear import QuantEmbedding, QuantLinear

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time"]
TOKENS = 24


@pytest.fixture(scope="module")
def default_backend():
    # Float activations in the quantized products, as transformers computes on the
    # dequantized file; the default int8 activations (llama.cpp's choice) move logits by
    # ~0.5% and may flip near-ties over 24 tokens.
    backend = load_backend(settings=BackendSettings(cpu_matmul="float32"))
    assert backend.platform.cpu_matmul in ("float32", None)
    assert backend.platform.cpu_gemm in ("float32", None)
    return backend


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


def test_resident_weights_stay_within_20_percent_of_the_file(default_backend):
    model = default_backend.model
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]
    float_linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert quantized
    assert not float_linears, "every matrix of the GGUF should stay in its stored blocks"
    resident = sum(m.weight_q.nbytes for m in quantized)
    resident += sum(t.numel() * t.element_size() for t in model.parameters())
    file_size = default_backend.source.path.stat().st_size
    assert resident <= 1.2 * file_size, (resident, file_size)


def test_structured_output_on_the_default_model(default_backend):
    import json

    import jsonschema

    ask = 'Give me a JSON object with the keys "name" and "age" for Alice, who is 30.'
    anything = default_backend.chat(
        [{"role": "user", "content": ask}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert anything.finish_reason == "stop"
    assert json.loads(anything.text) == {"name": "Alice", "age": 30}
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30},
            # Bounded: unbounded, this model writes digits until max_tokens.
            "population": {"type": "integer", "minimum": 0, "maximum": 10**8},
        },
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    }
    results = default_backend.generate(
        ["Paris as JSON: ", "Tokyo as JSON: "],
        max_tokens=60,
        temperature=1.0,
        seed=1,
        json_schema=schema,
    )
    for result in results:
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), schema)


def test_token_healing_mends_a_prompt_cut_after_a_space(default_backend):
    prompt = 'def hello_world():\n  print("Hello, '
    unhealed = default_backend.generate(prompt, max_tokens=3, temperature=0, token_healing=False)
    healed = default_backend.generate(prompt, max_tokens=3, temperature=0, token_healing=True)
    assert not unhealed.text.startswith("World")  # a word after the lone space token: "2020"
    assert healed.text.startswith("World")
    assert healed.usage.prompt_tokens == unhealed.usage.prompt_tokens - 1


def test_the_default_templates_plus_messages_are_reused_in_any_order(default_backend):
    """Gemma's template folds the system prompt into the first user turn; plus messages
    are templated alone, so every document is reused whichever comes first (spnl's RAG
    chat: a system prompt, the documents, a question)."""
    from helpers import plus_chat_usage

    default_backend.reset_prefix_cache()
    docs = [f"Document {i}: the {w} archive opened in {1990 + i}." for i, w in
            enumerate(["Halvorsen", "Quintero", "Abernathy", "Okonkwo"])]  # fmt: skip
    question = "When did the Okonkwo archive open?"
    first = plus_chat_usage(default_backend, docs, [0, 1, 2, 3], question)
    for order in ([2, 0, 3, 1], [3, 2, 1, 0]):
        again = plus_chat_usage(default_backend, docs, order, question)
        assert again.pic_miss_tokens == 0
        assert again.pic_hit_tokens == first.pic_miss_tokens


def test_spnls_warm_up_makes_the_rag_query_hit_every_fragment(default_backend):
    default_backend.reset_prefix_cache()
    docs = [f"Relevant Document {i}: the depot at gate {i} opens at {i + 6} am." for i in range(5)]
    meta = {"model": "spnl/x", "max_tokens": 1, "temperature": 0}
    default_backend.query({"map": {"metadata": meta, "inputs": docs}})
    plus = {"plus": [{"user": doc} for doc in reversed(docs)]}
    question = {"user": "When does the depot at gate 3 open?"}
    g = {**meta, "max_tokens": 8, "input": {"cross": [{"system": "Answer."}, plus, question]}}
    answer = default_backend.query({"repeat": {"n": 1, "g": g}})[0]
    assert answer.usage.pic_miss_tokens == 0
    assert answer.usage.pic_hit_tokens > 0


def test_the_default_models_16_prompts_give_the_same_tokens_at_1_and_2_threads():
    """The default arithmetic (int8 activations, float16 cache), its 16 prompts batched:
    the same greedy tokens whether one thread computes them or two."""
    from bench.batch_invariance import PROMPTS

    runs = []
    for threads in (1, 2):
        with load_backend(settings=BackendSettings(num_threads=threads)) as backend:
            results = backend.generate(PROMPTS, max_tokens=32, temperature=0)
            runs.append([result.token_ids for result in results])
    assert runs[0] == runs[1]
