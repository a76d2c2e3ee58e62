"""Penalties, filters and log-probabilities against direct reference computations on a
tiny model, and token healing's mask against the vocabulary itself."""

import pytest
import torch
from helpers import model_logits, run_together

from spnl_backend import BackendSettings, RequestError, load_backend
from spnl_backend.constrain.healing import back_off
from spnl_backend.engine.sampler import distribution
from spnl_backend.request import sampling_params
from spnl_backend.sampling import SamplingParams

PROMPT = "the cat sat on the mat and the dog"
TOKENS = 12


@pytest.fixture(scope="module")
def llama(tiny):
    """Without speculation: `seen` records the plain step's sampling stage, a row per
    sequence and step (verification under penalties is tested below)."""
    settings = BackendSettings(device="cpu", speculative_method="none")
    return load_backend(str(tiny.hf("llama").path), settings=settings)


def _reference_adjust(logits, prompt, output, p):
    """The penalties as their papers and OpenAI's docs state them, one token at a time."""
    logits = logits.clone()
    for token in set(prompt + output):
        if p.get("repetition_penalty", 1.0) != 1.0:
            r = p["repetition_penalty"]
            logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token in set(output):
        count = output.count(token)
        logits[token] -= p.get("frequency_penalty", 0.0) * count + p.get("presence_penalty", 0.0)
    for token, bias in p.get("logit_bias", {}).items():
        logits[int(token)] += bias
    return logits


PENALTIES = [
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.7},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.9},
    {"presence_penalty": -0.5, "frequency_penalty": 1.2, "repetition_penalty": 1.3},
    {"logit_bias": {"40": 6.0, "41": -100.0}},
]


@pytest.fixture
def seen(monkeypatch):
    """The raw logits each step handed to the sampling stage, per sequence."""
    from spnl_backend.engine import runner

    rows: dict[int, list[torch.Tensor]] = {}
    pick = runner.pick_next

    def recorded(logits, seqs):
        for row, seq in enumerate(seqs):
            rows.setdefault(seq.seq_id, []).append(logits[row].clone())
        return pick(logits, seqs)

    monkeypatch.setattr(runner, "pick_next", recorded)
    return rows


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: ",".join(p))
def test_penalties_and_logprobs_against_a_direct_computation(llama, seen, penalty):
    prompt = llama.tokenizer.encode(PROMPT)
    result = llama.generate(
        PROMPT, max_tokens=TOKENS, temperature=0, logprobs=True, top_logprobs=5, **penalty
    )
    (steps,) = seen.values()
    assert len(steps) == len(result.token_ids) == len(result.logprobs)
    for i, (token, entry) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        adjusted = _reference_adjust(steps[i], prompt, result.token_ids[:i], penalty)
        expected = torch.log_softmax(adjusted, -1)
        assert token == int(adjusted.argmax())
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(expected[token]), abs=1e-5)
        top = torch.topk(expected, 5)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    raw = model_logits(llama, prompt)[-1]  # and the raw logits are the model's own
    assert torch.allclose(steps[0], raw, atol=2e-2)  # its KV cache is float16


def test_penalties_change_the_output_and_are_batched_per_request(llama):
    plain = llama.generate(PROMPT, max_tokens=TOKENS, temperature=0)
    penalized = llama.generate(PROMPT, max_tokens=TOKENS, temperature=0, repetition_penalty=3.0)
    assert penalized.token_ids != plain.token_ids
    together = run_together(
        llama,
        lambda: llama.generate(PROMPT, max_tokens=TOKENS, temperature=0),
        lambda: llama.generate(PROMPT, max_tokens=TOKENS, temperature=0, repetition_penalty=3.0),
    )
    assert [r.token_ids for r in together] == [plain.token_ids, penalized.token_ids]


def test_logprobs_of_sampled_tokens_and_each_completion_its_own(llama, seen):
    results = llama.generate(
        [PROMPT, PROMPT], max_tokens=6, temperature=1.0, seed=7, logprobs=True, top_logprobs=3
    )
    assert results[0].token_ids != results[1].token_ids or results[0].logprobs
    for result, steps in zip(results, seen.values(), strict=True):
        for entry, logits in zip(result.logprobs, steps, strict=True):
            expected = torch.log_softmax(logits, -1)  # before temperature: see logits.py
            assert entry.logprob == pytest.approx(float(expected[entry.token_id]), abs=1e-5)
    assert llama.generate(PROMPT, max_tokens=3, temperature=0).logprobs is None


def test_min_p_drops_exactly_the_tokens_below_its_share_of_the_likeliest():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    probs = torch.softmax(logits, -1)
    for min_p in (0.0, 0.1, 0.3, 0.9, 1.0):
        kept = distribution(logits, SamplingParams(temperature=1.0, min_p=min_p)) > 0
        assert kept.tolist() == (probs >= min_p * probs.max()).tolist()
    hot = distribution(logits, SamplingParams(temperature=2.0, min_p=0.3)) > 0
    scaled = torch.softmax(logits / 2, -1)  # min-p reads the tempered distribution
    assert hot.tolist() == (scaled >= 0.3 * scaled.max()).tolist()


def test_stop_token_ids_and_ignore_eos(llama):
    plain = llama.generate(PROMPT, max_tokens=TOKENS, temperature=0)
    stop_at = plain.token_ids[3]
    first = plain.token_ids.index(stop_at)
    stopped = llama.generate(PROMPT, max_tokens=TOKENS, temperature=0, stop_token_ids=[stop_at])
    assert stopped.token_ids == plain.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    eos = 1  # tiny_models.EOS
    forced = {"logit_bias": {eos: 100}}
    assert llama.generate(PROMPT, max_tokens=5, temperature=0, **forced).token_ids == [eos]
    kept_going = llama.generate(PROMPT, max_tokens=5, temperature=0, ignore_eos=True, **forced)
    assert kept_going.token_ids == [eos] * 5
    assert kept_going.finish_reason == "length"


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty=2.5: expected a number in [-2, 2]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty="),
        ({"repetition_penalty": 0}, "repetition_penalty=0: expected a number in [0.01, 100]"),
        ({"logit_bias": {5: 1, "5": 2}}, "names token 5 twice"),
        ({"logit_bias": {"1" * 5000: 1}}, "logit_bias entry"),
        ({"min_p": -0.1}, "min_p=-0.1"),
        ({"logit_bias": {"5": 200}}, "logit_bias entry '5': 200"),
        ({"logit_bias": {"x": 1}}, "logit_bias entry 'x'"),
        ({"logit_bias": {10**6: 1}}, "logit_bias entry 1000000"),
        ({"logit_bias": [1]}, "logit_bias=[1]: expected a dict"),
        ({"stop_token_ids": [-1]}, "stop_token_ids=[-1]"),
        ({"stop_token_ids": 5}, "stop_token_ids=5"),
        ({"ignore_eos": 1}, "ignore_eos=1: expected True or False"),
        ({"logprobs": "yes"}, "logprobs='yes'"),
        (
            {"logprobs": True, "top_logprobs": 21},
            "top_logprobs=21: expected an integer from 0 to 20",
        ),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs=True"),
        ({"token_healing": "on"}, "token_healing='on'"),
        ({"frobnicate": 1}, "unknown parameter(s) 'frobnicate'"),
    ],
)
def test_every_value_is_checked(llama, options, words):
    with pytest.raises(RequestError) as raised:
        llama.generate(PROMPT, max_tokens=2, **options)
    assert words in str(raised.value)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters → the bytes they stand for: the printable Latin-1
    bytes stand for themselves, the others for characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


def _vocab_bytes(tokenizer) -> dict[int, bytes]:
    """Each ordinary token's bytes, from the byte-level BPE's own alphabet."""
    decode = _byte_level_alphabet()
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids)
    return {
        i: bytes(decode[c] for c in piece) for i, piece in enumerate(pieces) if i not in special
    }


@pytest.mark.parametrize("prompt", ["the ca", "the cat sat on the m", "x = 1 ", "hello wor"])
def test_healing_admits_exactly_the_tokens_that_start_with_the_backed_off_text(llama, tiny, prompt):
    ids = llama.tokenizer.encode(prompt)
    healed = back_off(ids, llama._grammars.prefix_index(), llama.tokenizer.decode)
    assert healed is not None
    assert healed.kept_ids == ids[:-1]
    vocab = _vocab_bytes(tiny.hf("llama").tokenizer)
    removed = vocab[ids[-1]]
    assert healed.text.encode() == removed
    assert prompt.endswith(healed.text)
    expected = {i for i, raw in vocab.items() if raw.startswith(removed)}
    assert set(healed.allowed_ids) == expected
    result = llama.generate(prompt, max_tokens=6, temperature=1.0, seed=2, token_healing=True)
    assert vocab[result.token_ids[0]].startswith(removed)
    full = llama.tokenizer.decode(healed.kept_ids + result.token_ids)
    assert prompt + result.text == full
    assert result.usage.prompt_tokens == len(ids) - 1


def test_healing_with_speculative_drafts_and_by_default(tiny, monkeypatch):
    from spnl_backend import BackendSettings, load_backend

    path = str(tiny.hf("llama").path)
    plain = load_backend(path, settings=BackendSettings(device="cpu"))
    expected = plain.generate("the ca", max_tokens=8, temperature=0, token_healing=True)
    spec = load_backend(
        path,
        settings=BackendSettings(device="cpu", speculative_draft_isq="Q8_0", token_healing=True),
    )
    assert spec.generate("the ca", max_tokens=8, temperature=0).token_ids == expected.token_ids
    unhealed = spec.generate("the ca", max_tokens=8, temperature=0, token_healing=False)
    assert unhealed.usage.prompt_tokens == expected.usage.prompt_tokens + 1


def test_a_prompt_of_one_token_is_left_as_it_is(llama):
    ids = llama.tokenizer.encode("x")[:1]
    assert back_off(ids, llama._grammars.prefix_index(), llama.tokenizer.decode) is None
    free = llama.generate(prompt_token_ids=ids, max_tokens=4, temperature=0)
    healed = llama.generate(prompt_token_ids=ids, max_tokens=4, temperature=0, token_healing=True)
    assert healed.token_ids == free.token_ids


def test_the_sampling_params_defaults_ask_for_nothing():
    params = sampling_params()
    assert not params.adjusts_logits
    assert params.constraint is None
    assert not params.logprobs
    assert not params.token_healing


def test_prefix_runs_are_found_at_every_byte_boundary():
    from spnl_backend.constrain.healing import TokenPrefixIndex

    tokens = [b"a", b"ab", b"a\xff", b"a\xff\xff", b"b", b"\xff", b"\xff\xfe", b"", b"abc"]
    index = TokenPrefixIndex(tokens, special={8}, vocab_size=len(tokens))
    for prefix in (b"a", b"ab", b"a\xff", b"\xff", b"b", b"c", b"\xff\xff"):
        expected = {i for i, t in enumerate(tokens) if t and i != 8 and t.startswith(prefix)}
        assert set(index.starting_with(prefix)) == expected, prefix


def test_speculative_decoding_keeps_penalties_and_logprobs(tiny, llama):
    spec = load_backend(
        str(tiny.hf("llama").path),
        settings=BackendSettings(device="cpu", speculative_draft_isq="Q8_0", speculative_gamma=4),
    )
    options = {"repetition_penalty": 1.5, "frequency_penalty": 0.7, "logit_bias": {40: 2.0}}
    expected = llama.generate(
        PROMPT, max_tokens=TOKENS, temperature=0, logprobs=True, top_logprobs=2, **options
    )
    result = spec.generate(
        PROMPT, max_tokens=TOKENS, temperature=0, logprobs=True, top_logprobs=2, **options
    )
    assert result.token_ids == expected.token_ids
    assert result.usage.accepted_tokens > 0  # drafts were verified under the penalties
    assert [e.logprob for e in result.logprobs] == pytest.approx(
        [e.logprob for e in expected.logprobs], abs=1e-3
    )


def test_numpys_booleans_and_integers_are_taken_as_plain_ones():
    import numpy

    from spnl_backend.plain import is_bool, plain_int
    from spnl_backend.request import sampling_params

    params = sampling_params(logprobs=numpy.bool_(True), top_logprobs=numpy.int64(2))
    assert params.logprobs is True
    assert params.top_logprobs == 2
    assert is_bool(numpy.bool_(False))  # numpy 2 names its type numpy.bool
    assert plain_int(numpy.bool_(True)) is None  # a bool is not a count


def test_a_stop_list_is_bounded_in_count_and_characters():
    from spnl_backend.errors import RequestError
    from spnl_backend.request import MAX_STOP_CHARS, MAX_STOP_STRINGS, stop_strings

    assert len(stop_strings([f"s{i}" for i in range(MAX_STOP_STRINGS)])) == MAX_STOP_STRINGS
    with pytest.raises(RequestError, match=f"at most {MAX_STOP_STRINGS} are taken"):
        stop_strings([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(RequestError, match="characters in all"):
        stop_strings(["x" * (MAX_STOP_CHARS // 2 + 1)] * 2)
