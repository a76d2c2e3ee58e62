"""Position-independent caching of plus blocks: the rule against a dense-mask reference,
hits against recomputes bit for bit, partial hits, shuffled documents, block boundaries,
eviction, preemption, mixed batches, the three ways in, and every malformed request."""

from functools import cache

import pytest
import torch
from helpers import engine_internals, engine_logits, greedy_with_logits, run_together
from pic_reference import reference_greedy
from tiny_models import ARCHITECTURES, PER_OP_ONLY

from spnl_backend import BackendSettings, load_backend
from spnl_backend.errors import ContextLengthError, RequestError, SettingsError
from spnl_backend.pic.pieces import PLUS_MARKER

PREFIX = "The quick brown fox jumps over the lazy dog."
DOCS = [
    "Once upon a time there was a little model that could.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]
QUESTION = "Tokens, tokens everywhere; caches and blocks and prefixes."
BLOCK = 16
TOKENS = 32
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</turn>"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _settings(**extra) -> BackendSettings:
    return BackendSettings(
        **{"device": "cpu", "isq": "Q8_0", "paged_attn_block_size": BLOCK, **extra}
    )


@cache
def _backend(path: str, **extra):
    return load_backend(path, settings=_settings(**extra))


def _fresh(path: str, **extra):
    return load_backend(path, settings=_settings(**extra))


def _pieces(backend, docs, prefix=PREFIX, question=QUESTION):
    encode = backend.tokenizer.encode_plain
    bos = backend.tokenizer.encode("")
    return [
        ("cross", bos + encode(prefix)),
        *[("plus", encode(doc)) for doc in docs],
        ("cross", encode(question)),
    ]


def _run(backend, pieces, tokens=TOKENS):
    """Greedy tokens, the first token's logits and the usage of one PIC request (past an
    end-of-sequence token, as the dense reference runs on)."""
    return greedy_with_logits(backend, tokens, blocks=pieces, ignore_eos=True)


@pytest.fixture(scope="module")
def trained(tiny):
    return str(tiny.trained().path)


# ---- the rule ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["after_prefix", "local", "sequential"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_pic_gives_the_dense_reference(tiny, arch, scheme):
    path = str(tiny.hf(arch).path)
    # Float activations and cache: int8 ones would round the reference's sums
    # differently (see the README's fidelity notes), which is chaos, not the rule.
    with _fresh(
        path, pic_positions=scheme, cpu_matmul="float32", paged_cache_type="f32"
    ) as backend:
        pieces = _pieces(backend, DOCS[:3])
        tokens, logits, usage = _run(backend, pieces)
        expected, expected_logits = reference_greedy(backend.model, pieces, scheme, TOKENS)
    assert usage.pic_miss_tokens == sum(len(ids) for kind, ids in pieces if kind == "plus")
    assert torch.allclose(logits, expected_logits, atol=1e-3, rtol=1e-3)
    assert tokens == expected


@pytest.mark.parametrize("scheme", ["after_prefix", "local", "sequential"])
def test_a_prompt_ending_in_plus_blocks_gives_the_reference(trained, scheme):
    # Float activations and cache, as against any dense reference: int8 ones round the
    # sums another way, which flips a near tie under sequential positions.
    floats = {"cpu_matmul": "float32", "paged_cache_type": "f32"}
    with _fresh(trained, pic_positions=scheme, **floats) as backend:
        pieces = _pieces(backend, DOCS[:2])[:-1]
        tokens, _, _ = _run(backend, pieces)
        again, _, usage = _run(backend, pieces)
        expected, _ = reference_greedy(backend.model, pieces, scheme, TOKENS)
    assert tokens == again == expected
    assert usage.pic_hit_tokens > 0  # the first element; the last is always computed


def test_the_plain_prompt_is_what_pic_without_plus_would_be(trained):
    """Spans change what a token sees: a PIC prompt is not its plain concatenation."""
    backend = _backend(trained)
    pieces = _pieces(backend, DOCS[:2])
    plain = backend.generate(
        prompt_token_ids=[t for _, ids in pieces for t in ids], max_tokens=TOKENS, temperature=0
    )
    expected, _ = reference_greedy(backend.model, pieces, "after_prefix", TOKENS)
    assert _run(backend, pieces)[0] == expected
    assert plain.usage.pic_hit_tokens == plain.usage.pic_miss_tokens == 0


# ---- reuse, exact -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [{}, {"paged_cache_type": "f32", "cpu_matmul": "float32"}],
    ids=["defaults", "float activations and cache"],  # the latter round nothing away
)
def test_a_hit_equals_a_miss_bit_for_bit(trained, extra):
    with _fresh(trained, **extra) as backend:
        pieces = _pieces(backend, DOCS[:3])
        cold_tokens, cold_logits, cold = _run(backend, pieces)
        warm_tokens, warm_logits, warm = _run(backend, pieces)
    plus = sum(len(ids) for kind, ids in pieces if kind == "plus")
    assert (cold.pic_hit_tokens, cold.pic_miss_tokens) == (0, plus)
    assert (warm.pic_hit_tokens, warm.pic_miss_tokens) == (plus, 0)
    assert warm.cached_tokens > plus
    assert torch.equal(warm_logits, cold_logits)
    assert warm_tokens == cold_tokens


@pytest.mark.parametrize(
    "extra", [{}, {"paged_cache_type": "f32", "cpu_matmul": "float32"}], ids=["defaults", "floats"]
)
def test_shuffled_documents_hit_and_equal_a_cold_run(trained, extra):
    with _fresh(trained, **extra) as backend:
        _run(backend, _pieces(backend, DOCS[:3]))
        shuffled = _pieces(backend, [DOCS[2], DOCS[0], DOCS[1]])
        tokens, logits, usage = _run(backend, shuffled)
    with _fresh(trained, **extra) as cold:
        cold_tokens, cold_logits, _ = _run(cold, shuffled)
    assert usage.pic_miss_tokens == 0
    assert torch.equal(logits, cold_logits)
    assert tokens == cold_tokens


def test_partial_hits_reuse_what_they_can(trained):
    with _fresh(trained) as backend:
        _run(backend, _pieces(backend, DOCS[:2]))
        pieces = _pieces(backend, [DOCS[1], DOCS[3]])
        tokens, logits, usage = _run(backend, pieces)
    with _fresh(trained) as cold:
        cold_tokens, cold_logits, _ = _run(cold, pieces)
    assert usage.pic_hit_tokens == len(pieces[1][1])
    assert usage.pic_miss_tokens == len(pieces[2][1])
    assert torch.equal(logits, cold_logits)
    assert tokens == cold_tokens


def test_a_different_prefix_is_a_miss_in_exact_mode_and_a_hit_when_relaxed(trained):
    for reuse, hit in (("exact", False), ("relaxed", True)):
        with _fresh(trained, pic_reuse=reuse) as backend:
            _run(backend, _pieces(backend, DOCS[:2]))
            other = _pieces(backend, DOCS[:2], prefix="Lazy dogs sleep all day long here.")
            _, _, usage = _run(backend, other)
        assert (usage.pic_hit_tokens > 0) == hit, reuse


@pytest.mark.parametrize("lengths", [(16, 32), (1, 17), (15, 16, 33)])
def test_elements_at_and_off_block_boundaries(trained, lengths):
    with _fresh(trained) as backend:
        words = backend.tokenizer.encode_plain(" ".join(DOCS * 2))
        docs = [words[i * 7 : i * 7 + n] for i, n in enumerate(lengths)]
        bos = backend.tokenizer.encode("")
        pieces = [("cross", bos + words[:BLOCK]), *[("plus", d) for d in docs]]
        pieces.append(("cross", words[-5:]))
        cold = _run(backend, pieces)
        warm = _run(backend, pieces)
        expected, _ = reference_greedy(backend.model, pieces, "after_prefix", TOKENS)
    assert warm[2].pic_miss_tokens == 0
    assert torch.equal(warm[1], cold[1])
    assert cold[0] == warm[0] == expected


# ---- the pool -------------------------------------------------------------------------------


def test_eviction_under_a_small_pool_keeps_results_exact(trained):
    with _fresh(trained, paged_attn_context_len=256) as backend:
        first = _pieces(backend, DOCS[:2])
        expected = _run(backend, first)
        for i in range(6):  # enough distinct documents to evict the first ones
            _run(backend, _pieces(backend, [f"{DOCS[i % 4]} Variation {i}." * 2]))
        again = _run(backend, first)
        pool = backend.stats().pool
    assert again[0] == expected[0]
    assert torch.equal(again[1], expected[1])
    assert pool.in_use == 0


def test_preemption_of_sequences_holding_shared_plus_blocks(trained):
    with _fresh(trained) as roomy:
        sets = [_pieces(roomy, docs) for docs in (DOCS[:2], DOCS[1:3], DOCS[:3], DOCS[2:])]
        serial = [_run(roomy, pieces)[0] for pieces in sets]
    with _fresh(trained, paged_attn_context_len=320) as tight:
        before = tight.stats().preemptions
        _run(tight, sets[0])  # its elements in the pool, for the others to share
        calls = [
            lambda p=p: tight.generate(blocks=p, max_tokens=TOKENS, temperature=0) for p in sets
        ]
        results = run_together(tight, *calls)
        preemptions = tight.stats().preemptions - before
    assert [r.token_ids for r in results] == serial
    assert preemptions > 0


def test_plain_requests_sharing_steps_with_pic_ones_are_unchanged(trained):
    backend = _backend(trained)
    plain = [PREFIX, "Lazy dogs", QUESTION]
    alone = [backend.generate(p, max_tokens=TOKENS, temperature=0).token_ids for p in plain]
    pieces = _pieces(backend, DOCS[:3])
    pic_alone = _run(backend, pieces)[0]
    calls = [lambda p=p: backend.generate(p, max_tokens=TOKENS, temperature=0) for p in plain]
    calls.append(lambda: backend.generate(blocks=pieces, max_tokens=TOKENS, temperature=0))
    results = run_together(backend, *calls)
    assert [r.token_ids for r in results[:-1]] == alone
    assert results[-1].token_ids == pic_alone


def test_blocks_are_returned_and_shared_blocks_counted_once(trained):
    with _fresh(trained) as backend:
        pieces = _pieces(backend, DOCS[:2])
        run_together(
            backend, *[lambda: backend.generate(blocks=pieces, max_tokens=4) for _ in range(3)]
        )
        pool = backend.stats().pool
        manager = engine_internals(backend).cache
    assert pool.in_use == 0
    assert not manager.pic
    assert not manager.tables
    assert all(block.ref_count == 0 for block in manager.blocks.blocks)


# ---- the ways in ----------------------------------------------------------------------------


def test_sentinel_token_ids_are_blocks(trained, monkeypatch):
    monkeypatch.setenv("SPNL_PIC_PLUS_TOKEN", "5")
    monkeypatch.setenv("SPNL_PIC_CROSS_TOKEN", "6")
    with _fresh(trained) as backend:
        pieces = _pieces(backend, DOCS[:2])
        expected = _run(backend, pieces)
        ids = pieces[0][1] + [5] + pieces[1][1] + [5] + pieces[2][1] + [6] + pieces[3][1]
        result = backend.generate(prompt_token_ids=ids, max_tokens=TOKENS, temperature=0)
        stream = "".join(backend.stream(prompt_token_ids=ids, max_tokens=TOKENS, temperature=0))
    assert result.token_ids == expected[0]
    assert result.usage.pic_hit_tokens == expected[2].pic_miss_tokens
    assert stream == result.text


def test_marked_and_grouped_chat_messages_are_plus(trained):
    with _fresh(trained) as backend:
        backend.tokenizer.hf.chat_template = TEMPLATE
        system = {"role": "system", "content": PREFIX}
        docs = [{"role": "user", "content": d} for d in DOCS[:2]]
        question = {"role": "user", "content": QUESTION}
        marked = [system] + [{**d, "content": PLUS_MARKER + d["content"]} for d in docs]
        marked.append(question)
        first = backend.chat(marked, max_tokens=TOKENS, temperature=0)
        grouped = backend.chat([system, docs[::-1], question], max_tokens=TOKENS, temperature=0)
        plain = backend.chat([system, *docs, question], max_tokens=TOKENS, temperature=0)
    assert first.usage.pic_miss_tokens > 0
    assert grouped.usage.pic_hit_tokens == first.usage.pic_miss_tokens
    assert grouped.usage.pic_miss_tokens == 0
    assert plain.usage.pic_hit_tokens == plain.usage.pic_miss_tokens == 0


async def _agenerate(backend, pieces):
    return await backend.agenerate(blocks=pieces, max_tokens=TOKENS, temperature=0)


def test_the_async_api_and_streams_take_blocks(trained):
    import asyncio

    backend = _backend(trained)
    pieces = _pieces(backend, DOCS[:2])
    expected = backend.generate(blocks=pieces, max_tokens=TOKENS, temperature=0)
    result = asyncio.run(_agenerate(backend, pieces))
    text = "".join(backend.stream(blocks=pieces, max_tokens=TOKENS, temperature=0))
    assert result.token_ids == expected.token_ids
    assert text == expected.text


# ---- malformed input ------------------------------------------------------------------------


class Hostile(list):
    """A list whose iteration raises."""

    def __iter__(self):
        raise RuntimeError("no")


@pytest.mark.parametrize(
    ("blocks", "says"),
    [
        ([], "non-empty list"),
        ("plus", "non-empty list"),
        ([("plus", "")], "empty"),
        ([("plus", [])], "token ids"),
        ([("minus", "text")], "'cross' or 'plus'"),
        ([("plus",)], "pair"),
        ([("plus", [10**9])], "token ids from 0"),
        ([("cross", "only cross")], "at least one plus"),
        ([("plus", "a lone \ud800 surrogate")], "not valid Unicode"),
        ([("plus", 3.5)], "token ids"),
        ([Hostile([("plus", "x")])], "'cross' or 'plus'"),
        (Hostile([("plus", "x")]), "non-empty list"),
    ],
)
def test_malformed_blocks_are_request_errors(trained, blocks, says):
    backend = _backend(trained)
    with pytest.raises(RequestError, match=says):
        backend.generate(blocks=blocks, max_tokens=2)
    assert backend.generate("Lazy dogs", max_tokens=2).token_ids  # nothing lost


def test_a_prompt_of_plus_token_ids_alone_runs_and_hits(trained):
    backend = _backend(trained)
    ids = backend.tokenizer.encode_plain(DOCS[0])
    first = backend.generate(blocks=[("plus", ids)], max_tokens=4, temperature=0)
    again = backend.generate(blocks=[("plus", ids), ("plus", ids)], max_tokens=4, temperature=0)
    assert first.usage.pic_miss_tokens == len(ids)
    assert again.usage.pic_hit_tokens >= len(ids)  # one copy, or both: the same element


def test_many_tiny_documents_that_do_not_fit_name_the_block_size_that_would(trained):
    # 40 documents of a few tokens: 40 blocks of 16 (640 slots) do not fit 512; of 8 do.
    with _fresh(trained, paged_attn_context_len=512) as backend:
        pieces = _pieces(backend, ["a b c"] * 40)
        with pytest.raises(ContextLengthError, match="MISTRALRS_PAGED_ATTN_BLOCK_SIZE=8"):
            backend.generate(blocks=pieces, max_tokens=1)
    with _fresh(trained, paged_attn_context_len=512, paged_attn_block_size=8) as backend:
        assert backend.generate(blocks=pieces, max_tokens=1).usage.pic_miss_tokens > 0


def test_a_chat_of_too_many_messages_is_refused(trained):
    from spnl_backend.pic.pieces import MAX_PIC_MESSAGES

    with _fresh(trained) as backend:
        backend.tokenizer.hf.chat_template = TEMPLATE
        many = [{"role": "user", "content": PLUS_MARKER + "x"}] * (MAX_PIC_MESSAGES + 1)
        with pytest.raises(RequestError, match="at most"):
            backend.chat(many, max_tokens=1)


def test_submit_refuses_what_is_not_a_checked_prompt(trained):
    from spnl_backend.request import sampling_params

    backend = _backend(trained)
    prompt = backend.prompt_ids(None, None, [("plus", "a document")])[0][0]
    for wrong in ([[prompt]], [["x"]], "ids", [[]]):
        with pytest.raises(RequestError, match="checked prompts"):
            backend.submit(wrong, sampling_params(max_tokens=1))
    assert backend.generate("Lazy dogs", max_tokens=2).token_ids


def test_blocks_and_a_prompt_together_are_refused(trained):
    with pytest.raises(RequestError, match="exactly one"):
        _backend(trained).generate("x", blocks=[("plus", "y")])


@pytest.mark.parametrize(
    ("ids", "says"),
    [
        ([5], "empty span"),
        ([3, 5, 6, 4], "empty span"),
        ([3, 5, 4, 5], "empty span"),
        ([3, 6], "empty span"),
        ([3, 6, 4], "at least one plus"),
    ],
)
def test_malformed_sentinel_prompts_are_request_errors(trained, monkeypatch, ids, says):
    monkeypatch.setenv("SPNL_PIC_PLUS_TOKEN", "5")
    monkeypatch.setenv("SPNL_PIC_CROSS_TOKEN", "6")
    with _fresh(trained) as backend, pytest.raises(RequestError, match=says):
        backend.generate(prompt_token_ids=ids, max_tokens=2)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"SPNL_PIC_PLUS_TOKEN": "5"}, "SPNL_PIC_CROSS_TOKEN is not"),
        ({"SPNL_PIC_PLUS_TOKEN": "5", "SPNL_PIC_CROSS_TOKEN": "5"}, "different"),
        ({"SPNL_PIC_PLUS_TOKEN": "5", "SPNL_PIC_CROSS_TOKEN": "99999999"}, "token id from 0"),
        ({"SPNL_PIC_PLUS_TOKEN": "-1", "SPNL_PIC_CROSS_TOKEN": "6"}, "a number >= 0"),
    ],
)
def test_bad_sentinel_settings_fail_the_load(trained, monkeypatch, env, says):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=says):
        _fresh(trained)


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "user", "content": PLUS_MARKER}], "followed by nothing"),
        ([{"role": "user", "content": "q"}, []], "empty group"),
        ([[{"role": "user"}]], "string 'role' and 'content'"),
    ],
)
def test_malformed_chat_messages_are_request_errors(trained, messages, says):
    with _fresh(trained) as backend:
        backend.tokenizer.hf.chat_template = TEMPLATE
        with pytest.raises(RequestError, match=says):
            backend.chat(messages, max_tokens=2)


@pytest.mark.parametrize(
    ("extra", "says"),
    [({"paged_attn": False}, "paged"), ({"kv_cache_compression": "tq4"}, "compressed")],
)
def test_backends_that_cannot_run_pic_say_why(trained, extra, says):
    with _fresh(trained, **extra) as backend, pytest.raises(RequestError, match=says):
        backend.generate(blocks=[("plus", "a document")], max_tokens=2)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_pic_steps_on_the_layer_blocks_give_the_per_op_bits(tiny, arch, block_runs):
    """The native layer blocks read PIC key lists too (a second table for the layers with a
    window): the same bits as the per-op path, alone and beside a plain request."""
    path = str(tiny.hf(arch).path)
    results = []
    for blocks in (False, True):
        with _fresh(path) as backend:
            backend.model.model.use_layer_blocks = blocks
            pieces = _pieces(backend, DOCS[:3])
            tokens, logits, _ = _run(backend, pieces)
            both = run_together(
                backend,
                lambda b=backend: b.generate(PREFIX, max_tokens=TOKENS, temperature=0),
                lambda b=backend, p=pieces: b.generate(blocks=p, max_tokens=TOKENS, temperature=0),
            )
            results.append((tokens, logits, [r.token_ids for r in both]))
    assert (block_runs[0] > 0) == (arch not in PER_OP_ONLY)
    assert torch.equal(results[0][1], results[1][1])
    assert results[0][0] == results[1][0]
    assert results[0][2] == results[1][2]
    assert results[1][2][1] == results[1][0]


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_a_plain_prompt_hitting_a_pic_prompts_prefix_gets_its_own_bits(tiny, arch):
    """The first cross span of a PIC prompt shares the prefix cache's keys, so its tokens
    attend exactly as a plain prompt's would (key lists chunked alike, past the window)."""
    path = str(tiny.hf(arch).path)
    # Float activations and cache: int8 and float16 would round the difference away.
    exact = {"paged_cache_type": "f32", "cpu_matmul": "float32"}
    with _fresh(path, **exact) as backend:
        words = backend.tokenizer.encode_plain(" ".join(DOCS * 12))
        # Past 256 keys (the kernel's chunk) a window's keys straddle two chunks: tokens
        # 257-263 here, whose differences would reach the plain prompt's first queries.
        head, tail = words[:280], words[280:292]
        backend.generate(blocks=[("cross", head), ("plus", words[320:330])], max_tokens=1)
        plain = backend.generate(prompt_token_ids=head + tail, max_tokens=TOKENS, temperature=0)
        logits = engine_logits(backend, head + tail)
    with _fresh(path, **exact) as cold:
        expected = cold.generate(prompt_token_ids=head + tail, max_tokens=TOKENS, temperature=0)
        expected_logits = engine_logits(cold, head + tail)
    assert plain.usage.cached_tokens == 272  # the full blocks the PIC prompt computed
    assert plain.token_ids == expected.token_ids
    assert torch.equal(logits, expected_logits)


def test_relaxed_reuse_keys_what_follows_a_group_exactly(trained):
    """Relaxed reuse loosens the elements' keys only: a cross span after a group that came
    after another prefix is computed, not taken from the first request."""
    with _fresh(trained, pic_reuse="relaxed") as backend:
        words = backend.tokenizer.encode_plain(" ".join(DOCS * 3))
        doc, question = words[:20], words[20:70]
        first = [("cross", words[70:90]), ("plus", doc), ("cross", question)]
        backend.generate(blocks=first, max_tokens=1)
        other = [("cross", words[90:110]), ("plus", doc), ("cross", question)]
        usage = backend.generate(blocks=other, max_tokens=1).usage
    assert usage.pic_hit_tokens == len(doc)
    assert usage.cached_tokens == len(doc)  # nothing of the question


def test_a_self_drafted_backend_refuses_pic_prompts(trained):
    refused = pytest.raises(RequestError, match="speculative draft")
    with _fresh(trained, speculative_draft_isq="Q4_0") as backend, refused:
        backend.generate(blocks=[("plus", "a document")], max_tokens=2)


def test_what_a_template_renders_before_the_first_turn_stays_cross(trained):
    """A template that starts a conversation with its own system turn (when the first
    message is not one) puts it in the preamble, never in a plus message's span: each
    message is templated alone, so the document's element is the same wherever it is."""
    injecting = (
        "{% if messages[0]['role'] != 'system' %}<system>Be brief.</turn>{% endif %}" + TEMPLATE
    )
    with _fresh(trained) as backend:
        backend.tokenizer.hf.chat_template = injecting
        doc = {"role": "user", "content": PLUS_MARKER + DOCS[0]}
        question = {"role": "user", "content": QUESTION}
        first = backend.chat([doc, question], max_tokens=2)
        second = backend.chat([doc, {"role": "user", "content": "Who?"}], max_tokens=2)
    assert first.usage.pic_miss_tokens > 0
    assert second.usage.pic_hit_tokens == first.usage.pic_miss_tokens
    assert second.usage.pic_miss_tokens == 0


class HostileText(str):
    def startswith(self, *args):
        raise RuntimeError("no")


class HostileLength(list):
    def __len__(self):
        raise RuntimeError("no")


def test_hostile_chat_objects_are_read_as_plain_values(trained):
    with _fresh(trained) as backend:
        backend.tokenizer.hf.chat_template = TEMPLATE
        plain = backend.chat([{"role": "user", "content": HostileText("x")}], max_tokens=2)
        marked = HostileText(PLUS_MARKER + "a document")
        pic = backend.chat(
            [{"role": "user", "content": "q"}, {"role": "user", "content": marked}], max_tokens=2
        )
        with pytest.raises(RequestError, match="group"):
            backend.chat(
                [{"role": "user", "content": "q"}, HostileLength([{"role": "user"}])],
                max_tokens=2,
            )
    assert plain.usage.pic_miss_tokens == 0
    assert pic.usage.pic_miss_tokens > 0


def test_chat_errors_name_the_message_they_are_about(trained):
    with _fresh(trained) as backend:
        backend.tokenizer.hf.chat_template = TEMPLATE
        good = {"role": "user", "content": PLUS_MARKER + "x"}
        with pytest.raises(RequestError, match=r"messages\[2\] = "):
            backend.chat([good, good, {"role": 1}], max_tokens=1)
        with pytest.raises(RequestError, match=r"messages\[1\]\[0\]"):
            backend.chat([good, [{"content": "x"}]], max_tokens=1)
