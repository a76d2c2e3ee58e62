"""The quick form of a saved tokenizer conversion (`loader.tokenizer._read_quick`), on tiny
BPE vocabularies: made once, parsed back to the same definition, made again when damaged
or when the conversion changes, and left in pair form where a token holds a space."""

import json
import zlib
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

import spnl_backend.loader.tokenizer as tokenizer_module
from spnl_backend import ModelFileError
from spnl_backend.loader.tokenizer import _load_converted

TEXTS = ["abab", "a b", "ba  ab", "", "cab a"]


def _saved(directory: Path, vocab: dict[str, int], merges: list[tuple[str, str]]) -> Path:
    """A conversion saved as transformers saves one: tokenizer.json and its config."""
    directory.mkdir()
    rust = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    rust.add_special_tokens(["<eos>"])
    rust.save(str(directory / "tokenizer.json"), pretty=True)
    config = {"eos_token": "<eos>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def plain(tmp_path):
    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "abab": 5, "ca": 6}
    return _saved(tmp_path / "plain", vocab, [("a", "b"), ("ab", "ab"), ("c", "a")])


def _quick(directory: Path) -> list[Path]:
    return sorted(directory.glob("tokenizer.quick-*.json"))


def _same_as_saved(directory: Path) -> None:
    saved = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ours = _load_converted(directory).rust
    assert ours.to_str() == saved.to_str()
    for text in TEXTS:
        assert ours.encode(text).ids == saved.encode(text).ids, text


def test_made_once_with_string_merges_and_read_from_then_on(plain, monkeypatch):
    _same_as_saved(plain)
    (quick,) = _quick(plain)
    model = json.loads(quick.read_text())["model"]
    assert model["merges"] == ["a b", "ab ab", "c a"]
    assert list(model["vocab"]) == sorted(model["vocab"], key=str.encode)

    def no_saved(*args):
        raise AssertionError("tokenizer.json parsed although the quick form exists")

    monkeypatch.setattr(tokenizer_module, "_parse_saved", no_saved)
    _same_as_saved(plain)


def test_a_token_with_a_space_keeps_the_merges_as_pairs(tmp_path):
    vocab = {"<unk>": 0, "a": 1, " ": 2, "b": 3, "a ": 4, "a b": 5}
    spaced = _saved(tmp_path / "spaced", vocab, [("a", " "), ("a ", "b")])
    _same_as_saved(spaced)
    (quick,) = _quick(spaced)
    assert json.loads(quick.read_text())["model"]["merges"] == [["a", " "], ["a ", "b"]]
    assert _load_converted(spaced).rust.encode("a b").ids == [5]


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # cut short: its CRC no longer matches
        lambda data: data.replace(b'"a b"', b'"b a"'),  # a flipped merge, CRC wrong
    ],
)
def test_a_damaged_quick_form_is_made_again(plain, damage):
    _load_converted(plain)
    (quick,) = _quick(plain)
    quick.write_bytes(damage(quick.read_bytes()))
    _same_as_saved(plain)
    (again,) = _quick(plain)
    assert again.name == quick.name
    _same_as_saved(plain)


def test_a_quick_form_that_does_not_parse_is_made_again(plain):
    """Bytes that match the CRC in the name but are no tokenizer."""
    _load_converted(plain)
    (quick,) = _quick(plain)
    junk = b'{"model": '
    quick.unlink()
    prefix = quick.name.rsplit(".", 2)[0]
    (plain / f"{prefix}.{zlib.crc32(junk):08x}.json").write_bytes(junk)
    _same_as_saved(plain)
    assert len(_quick(plain)) == 1


def test_a_changed_conversion_gets_a_new_quick_form(plain):
    _load_converted(plain)
    (old,) = _quick(plain)
    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "ba": 5}
    other = _saved(plain.parent / "other", vocab, [("a", "b"), ("b", "a")])
    (plain / "tokenizer.json").write_text((other / "tokenizer.json").read_text())
    _same_as_saved(plain)
    assert old in _quick(plain)
    assert len(_quick(plain)) == 2
    assert _load_converted(plain).rust.encode("ba").ids == [5]


def test_a_cache_that_cannot_be_written_costs_only_speed(plain, monkeypatch):
    def refuse(data, target):
        raise OSError("read-only file system")

    monkeypatch.setattr(tokenizer_module, "_write_whole", refuse)
    _same_as_saved(plain)
    assert _quick(plain) == []


@pytest.mark.parametrize(
    "form",
    [
        lambda rust: b"{",  # does not parse
        lambda rust: rust.to_str().replace('"ab":4', '"ab":5').encode(),  # another definition
    ],
)
def test_a_quick_form_that_is_not_the_conversion_is_refused_once(plain, monkeypatch, form):
    monkeypatch.setattr(tokenizer_module, "_quick_form", form)
    _same_as_saved(plain)
    assert _quick(plain) == []
    assert len(list(plain.glob("tokenizer.quick-*.none"))) == 1

    def again(rust):
        raise AssertionError("a refused quick form was made again")

    monkeypatch.setattr(tokenizer_module, "_quick_form", again)
    _same_as_saved(plain)


def test_a_damaged_saved_conversion_is_a_model_file_error(plain):
    (plain / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelFileError, match=r"cached conversion cannot be read.*delete"):
        _load_converted(plain)
