"""Structured output: every kind of constraint gives output that parses and validates,
alone, batched beside free requests (which it leaves untouched), with speculative
decoding, under preemption, with prefix-cache hits, paged or not; and bad constraints are
clear errors."""

import json
import re

import jsonschema
import pytest
from helpers import engine_internals
from tiny_models import build_hf_model

from spnl_backend import BackendSettings, RequestError, load_backend
from spnl_backend.request import sampling_params
from spnl_backend.results import read_results

SCHEMAS = [
    {  # nested objects, optional fields, bounded strings and integers
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
            "vip": {"type": "boolean"},
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    {  # an array with bounds, of enums
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 4,
    },
    {  # numbers, a pattern, an array of bounded strings
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "score": {"type": "integer", "minimum": -10, "maximum": 10},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        },
        "required": ["id", "score"],
        "additionalProperties": False,
    },
]
PROMPTS = ["hello", "the cat sat", "x = 1", "a b c d e"]
TOKENS = 160
REGEX = r"[0-9]{3}-[a-z]{2,4}( ok)?"
LARK = 'start: "yes" | "no" | "maybe " WORD\nWORD: /[a-z]{1,6}/'
GBNF = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'
CHOICES = ["alpha", "beta gamma", "δ"]


def _check_schema(schema):
    def check(text):
        jsonschema.validate(json.loads(text), schema)

    return check


def _check_regex(pattern):
    return lambda text: re.fullmatch(pattern, text) or pytest.fail(f"{text!r} !~ {pattern}")


KINDS = [
    *[({"json_schema": s}, _check_schema(s)) for s in SCHEMAS],
    ({"regex": REGEX}, _check_regex(REGEX)),
    ({"grammar": LARK}, _check_regex(r"yes|no|maybe [a-z]{1,6}")),
    ({"grammar": GBNF}, _check_regex(r"\([0-9]+\)")),
    ({"choice": CHOICES}, lambda text: text in CHOICES or pytest.fail(repr(text))),
]
# Any JSON object (unbounded keys and strings) is checked on the real model
# (test_real_model.py): a random tiny model can write one string until max_tokens.
KIND_IDS = ["nested", "array", "pattern", "regex", "lark", "gbnf", "choice"]


def _valid(results, check):
    for result in results:
        assert result.finish_reason == "stop", result.text
        check(result.text)


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny.backend("llama")


@pytest.mark.parametrize(("kind", "check"), KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_parses_and_validates(llama, kind, check, temperature):
    results = llama.generate(PROMPTS, max_tokens=TOKENS, temperature=temperature, seed=3, **kind)
    _valid(results, check)
    alone = llama.generate(PROMPTS[1], max_tokens=TOKENS, temperature=temperature, seed=3, **kind)
    assert alone.token_ids == results[1].token_ids  # the batch changed nothing


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_free_requests_beside_constrained_ones_are_untouched(llama, temperature):
    free = sampling_params(max_tokens=24, temperature=temperature, seed=9)
    expected = [
        r.token_ids for r in llama.generate(PROMPTS, max_tokens=24, temperature=temperature, seed=9)
    ]
    ids = [llama.tokenizer.encode(p) for p in PROMPTS]
    requests = [
        llama.submit(
            ids,
            sampling_params(max_tokens=24, temperature=temperature, seed=9, json_schema=SCHEMAS[0]),
        ),
        llama.submit(ids, free),
        llama.submit(
            ids, sampling_params(max_tokens=24, temperature=temperature, seed=9, choice=CHOICES)
        ),
    ]
    results = [read_results(request, single=False) for request in requests]
    assert [r.token_ids for r in results[1]] == expected


def test_paged_off_and_prefix_cache_hits_give_the_same_output(tiny):
    path = tiny.hf("llama").path
    paged = load_backend(str(path), settings=BackendSettings(device="cpu", paged_attn=True))
    plain = load_backend(str(path), settings=BackendSettings(device="cpu", paged_attn=False))
    prompt = "the cat sat on the mat and " * 4  # whole blocks for the prefix cache
    first = paged.generate(prompt, max_tokens=TOKENS, temperature=0, json_schema=SCHEMAS[2])
    second = paged.generate(prompt, max_tokens=TOKENS, temperature=0, json_schema=SCHEMAS[2])
    assert second.usage.cached_tokens > 0
    other = plain.generate(prompt, max_tokens=TOKENS, temperature=0, json_schema=SCHEMAS[2])
    assert first.token_ids == second.token_ids == other.token_ids
    _valid([first], _check_schema(SCHEMAS[2]))


def test_preemption_restores_the_matcher(tiny):
    path = tiny.hf("llama").path
    roomy = load_backend(
        str(path), settings=BackendSettings(device="cpu", paged_attn=True, paged_attn_block_size=8)
    )
    tight = load_backend(
        str(path),
        settings=BackendSettings(
            device="cpu", paged_attn=True, paged_attn_block_size=8, paged_attn_context_len=96
        ),
    )
    prompts = [p * 3 for p in PROMPTS]
    kind = {"json_schema": SCHEMAS[0]}
    expected = roomy.generate(prompts, max_tokens=60, temperature=1.0, seed=4, **kind)
    results = tight.generate(prompts, max_tokens=60, temperature=1.0, seed=4, **kind)
    assert tight.stats().preemptions > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    for result in results:
        if result.finish_reason == "stop":
            _check_schema(SCHEMAS[0])(result.text)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return build_hf_model("llama", tmp_path_factory.mktemp("draft") / "draft", seed=1).path


@pytest.mark.parametrize("draft_kind", ["other model", "self Q8_0"])
@pytest.mark.parametrize(
    ("kind", "check"), [KINDS[0], KINDS[3], KINDS[6]], ids=["schema", "regex", "choice"]
)
def test_speculative_decoding_keeps_the_constrained_output(
    tiny, llama, draft, draft_kind, kind, check
):
    extra = (
        {"speculative_draft_model": str(draft)}
        if draft_kind == "other model"
        else {"speculative_draft_isq": "Q8_0"}
    )
    spec = load_backend(
        str(tiny.hf("llama").path),
        settings=BackendSettings(device="cpu", speculative_gamma=4, **extra),
    )
    expected = llama.generate(PROMPTS, max_tokens=TOKENS, temperature=0, **kind)
    results = spec.generate(PROMPTS, max_tokens=TOKENS, temperature=0, **kind)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert sum(r.usage.draft_tokens for r in results) > 0
    _valid(results, check)
    sampled = spec.generate(PROMPTS, max_tokens=TOKENS, temperature=1.0, seed=2, **kind)
    _valid(sampled, check)


def test_a_grammar_cut_short_by_max_tokens_says_length(llama):
    result = llama.generate("hello", max_tokens=3, temperature=0, json_schema=SCHEMAS[0])
    assert result.finish_reason == "length"


def test_eos_only_where_the_grammar_accepts(llama):
    eos = engine_internals(llama).config.eos_token_ids
    result = llama.generate("hello", max_tokens=TOKENS, temperature=1.0, seed=1, regex="[a-c]{4}")
    assert re.fullmatch("[a-c]{4}", result.text)
    assert result.token_ids[-1] in eos  # it ended on EOS, once the four letters were out
    assert all(t not in eos for t in result.token_ids[:-1])


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ({"json_schema": {"type": "nonsense"}}, "JSON schema does not compile"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"json_schema": 3}, "json_schema=3: expected a JSON schema"),
        ({"regex": "(unclosed"}, "regex does not compile"),
        ({"regex": ""}, "regex='': expected a non-empty"),
        ({"grammar": "start: missing_rule"}, "grammar does not compile"),
        ({"choice": []}, "choice=[]: expected a list of 1 to"),
        ({"choice": ["a", 3]}, "expected a list of 1 to"),
        ({"response_format": {"type": "xml"}}, "response_format="),
        ({"response_format": {"type": "json_schema"}}, "response_format['json_schema']"),
        ({"regex": "a", "choice": ["a"]}, "at most one of"),
        ({"regex": "a", "ignore_eos": True}, "ignore_eos=True cannot be combined"),
        ({"regex": "a", "token_healing": True}, "token_healing=True cannot be combined"),
        ({"json_schema": False}, "a schema that no value matches"),
        ({"json_schema": {"type": "number", "minimum": float("nan")}}, "cannot be written as JSON"),
        ({"json_schema": '{"minimum": NaN}'}, "is not valid JSON"),
        ({"json_schema": "[" * 5000}, "json_schema nests JSON arrays and objects more than"),
        ({"regex": "\ud800"}, "regex is not valid Unicode text"),
        ({"choice": ["ok", "\ud800"]}, "choice is not valid Unicode text"),
        ({"json_schema": {"pattern": "\ud800"}}, "json_schema is not valid Unicode text"),
    ],
)
def test_a_bad_constraint_is_a_clear_request_error(llama, kind, message):
    with pytest.raises(RequestError, match=re.escape(message)):
        llama.generate("hello", max_tokens=4, **kind)
    assert llama.generate("hello", max_tokens=2, temperature=0).finish_reason  # still serving


def test_response_format_text_asks_for_nothing(llama):
    plain = llama.generate("hello", max_tokens=8, temperature=0)
    text = llama.generate("hello", max_tokens=8, temperature=0, response_format={"type": "text"})
    assert text.token_ids == plain.token_ids


def test_stream_and_async_take_constraints(llama):
    import asyncio

    streamed = "".join(llama.stream("hello", max_tokens=TOKENS, temperature=0, choice=CHOICES))
    assert streamed in CHOICES
    whole = asyncio.run(llama.agenerate("hello", max_tokens=TOKENS, temperature=0, choice=CHOICES))
    assert whole.text == streamed


@pytest.mark.parametrize("compression", ["int8", "tq4"])
def test_compressed_caches_take_constraints(tiny, compression):
    backend = load_backend(
        str(tiny.hf("llama").path),
        settings=BackendSettings(device="cpu", kv_cache_compression=compression),
    )
    results = backend.generate(PROMPTS, max_tokens=TOKENS, temperature=1.0, seed=5, **KINDS[0][0])
    _valid(results, KINDS[0][1])
    choice = backend.generate(PROMPTS[0], max_tokens=TOKENS, temperature=0, choice=CHOICES)
    assert choice.text in CHOICES


def test_a_schema_of_true_is_any_json_value(llama):
    result = llama.generate("hello", max_tokens=TOKENS, temperature=0, json_schema=True)
    if result.finish_reason == "stop":
        json.loads(result.text)


def test_a_long_chain_of_rules_is_compiled_not_a_crash(llama):
    """llguidance's checks recurse once per rule of a chain: thousands of them overflowed
    a default thread stack and killed the process."""
    rules = 20_000
    chain = "\n".join(f'r{i}: "x" r{i + 1}' for i in range(rules))
    grammar = f'start: r0\n{chain}\nr{rules}: "y"'
    result = llama.generate("hello", max_tokens=5, temperature=0, grammar=grammar)
    assert result.text == "xxxxx"


def test_a_grammar_past_llguidances_limits_fails_its_request_alone(llama):
    """No base case: every token adds parser items until llguidance's limit, mid-way."""
    plain = llama.generate(PROMPTS, max_tokens=12, temperature=0)
    ids = [llama.tokenizer.encode(p) for p in PROMPTS]
    endless = llama.submit(
        [ids[0]], sampling_params(max_tokens=60, temperature=0, grammar='start: a\na: "x" a')
    )
    free = llama.submit(ids, sampling_params(max_tokens=12, temperature=0))
    with pytest.raises(RequestError, match="the output's constraint"):
        read_results(endless, single=True)
    assert [r.token_ids for r in read_results(free, single=False)] == [r.token_ids for r in plain]
    assert llama.stats().running == 0


def test_n_completions_and_pic_prompts_take_constraints(llama):
    request = llama.submit(
        [llama.tokenizer.encode("hello")],
        sampling_params(max_tokens=TOKENS, temperature=1.0, seed=2, choice=CHOICES),
        n=3,
    )
    assert all(r.text in CHOICES for r in read_results(request, single=False))
    blocks = [("cross", "answer from these"), ("plus", "alpha beta"), ("plus", "gamma")]
    pic = llama.generate(blocks=blocks, max_tokens=TOKENS, temperature=0, regex=REGEX)
    assert pic.finish_reason == "stop"
    assert re.fullmatch(REGEX, pic.text)
