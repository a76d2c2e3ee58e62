"""The GGUF tokenizer read by the tokenizers library directly, against transformers' fast
tokenizer over the same converted vocabulary (the default model's: 262k tokens, 6,384
added ones)."""

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from spnl_backend import ModelFileError, load_backend
from spnl_backend.loader.tokenizer import _cache_key, _load_converted, load_gguf_tokenizer
from spnl_backend.settings.paths import cache_dir

TEXTS = [
    "The capital of France is",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n and \u00a0 non-breaking",
    "é ü ñ 中文 日本語 한국어 😀👍🏽 \u200b zero width",
    "<bos><eos><pad><unk><mask> as text",
    "<unused3> <unused99> <start_of_image>",
    "\x00\x01\x7f control characters",
    "def f(x):\n    return x ** 2  # code\n",
    "",
]
# Random texts: pieces of characters, spaces and the added tokens' own strings, joined.
PIECES = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=6),
    st.sampled_from([" ", "  ", "\n", "▁", "<", ">", "<start_of_turn>", "<eos>", "<unused7>"]),
)


@pytest.fixture(scope="module")
def converted():
    """The default model's cached conversion (made by its first load)."""
    backend = load_backend()
    path = backend.source.path
    backend.close()
    return cache_dir("tokenizers") / _cache_key(path)


@pytest.fixture(scope="module")
def pair(converted):
    config = json.loads((converted / "tokenizer_config.json").read_text())
    specials = {k: v for k, v in config.items() if k.endswith("_token") and v is not None}
    reference = PreTrainedTokenizerFast(
        tokenizer_file=str(converted / "tokenizer.json"), **specials
    )
    return _load_converted(converted), reference


def _same(ours, reference, text: str) -> None:
    for special in (True, False):
        ids = ours(text, add_special_tokens=special)["input_ids"]
        assert ids == reference(text, add_special_tokens=special)["input_ids"], (text, special)
        for skip in (True, False):
            got = ours.decode(ids, skip_special_tokens=skip)
            assert got == reference.decode(ids, skip_special_tokens=skip), (text, skip)


@pytest.mark.parametrize("text", TEXTS)
def test_the_same_ids_and_text_as_transformers(pair, text):
    _same(*pair, text)


@settings(max_examples=150, deadline=None)
@given(st.lists(PIECES, max_size=12).map("".join))
def test_random_texts_give_the_same_ids_and_text(pair, text):
    _same(*pair, text)


def test_encoding_goes_through_the_call_that_lets_go_of_the_gil(pair):
    """The tokenizers library's `encode` holds the GIL while it works (a 7 MB prompt
    stopped every other thread of the host for 5 s); `encode_batch` lets go of it. The
    ids are the same (above); this checks which call gives them."""
    ours, _ = pair
    calls = []

    class Watched:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ours.rust, name)

    watched = type(ours)(Watched(), {}, None)
    assert watched("The capital", add_special_tokens=True)["input_ids"] == (
        ours.rust.encode("The capital").ids
    )
    assert "encode_batch" in calls
    assert "encode" not in calls


def test_the_same_special_tokens_vocabulary_and_decoding_of_any_ids(pair):
    ours, reference = pair
    assert len(ours) == len(reference)
    assert ours.eos_token_id == reference.eos_token_id
    assert ours.special_tokens_map == reference.special_tokens_map
    assert ours.get_vocab() == reference.get_vocab()
    ids = [2, 105, 0, 1, 3, 236743, 238, 255968, 262143, 7, 106]  # byte pieces, specials
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )


def test_the_quick_form_is_the_saved_conversion_with_string_merges(converted, pair):
    """What a load parses (the quick form) against tokenizer.json parsed as saved: the
    same definition (all 262k tokens, 515k merges in order, specials, pipeline)."""
    (quick,) = converted.glob("tokenizer.quick-*.json")
    merges = json.loads(quick.read_text())["model"]["merges"]
    assert len(merges) > 500_000
    assert all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    saved = Tokenizer.from_file(str(converted / "tokenizer.json"))
    ours = pair[0].rust
    assert ours.to_str() == saved.to_str()
    for text in TEXTS:
        for special in (True, False):
            got = ours.encode(text, add_special_tokens=special).ids
            assert got == saved.encode(text, add_special_tokens=special).ids, text


def test_a_damaged_cached_conversion_is_a_model_file_error(converted, tmp_path, monkeypatch):
    damaged = tmp_path / converted.name
    damaged.mkdir()
    (damaged / "tokenizer_config.json").write_text(
        (converted / "tokenizer_config.json").read_text()
    )
    (damaged / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelFileError, match=r"cached conversion cannot be read.*delete"):
        _load_converted(damaged)
    monkeypatch.setattr("spnl_backend.loader.tokenizer.cache_dir", lambda name: tmp_path)
    monkeypatch.setattr("spnl_backend.loader.tokenizer._cache_key", lambda path: damaged.name)
    with pytest.raises(ModelFileError, match=str(damaged)):
        load_gguf_tokenizer(converted, "gemma3", [1])


def test_loading_a_converted_gguf_does_not_import_transformers(converted):
    """Importing transformers took half a second of every load."""
    code = (
        "import sys\nfrom spnl_backend import load_backend\n"
        "backend = load_backend()\n"
        "assert backend.generate('Hi', max_tokens=2, temperature=0).token_ids\n"
        "print('transformers' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
