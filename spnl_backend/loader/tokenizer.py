"""Tokenizers: transformers' own for text models, and for GGUF files the one transformers
converts from the file's vocabulary, cached after the first (slow) conversion and then
read by the tokenizers library directly (`VocabTokenizer`): importing transformers and
building its wrapper took longer than reading the vocabulary itself. Beside the saved
conversion sits its quick form (`_read_quick`), what a load parses."""

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import tokenizers
from tokenizers import Tokenizer as RustTokenizer

from ..errors import ModelFileError, RequestError
from ..log import get_logger
from ..models.arch import family, family_of_gguf
from ..settings.paths import cache_dir
from .chat_template import ChatTemplate, request_template
from .gguf_file import GGUFFile

log = get_logger()

# Families whose GGUF vocabularies transformers' AutoTokenizer converts
# (`Family.gguf_auto_tokenizer`), as it always has here, so their cached conversions stay
# byte for byte what they were. AutoTokenizer parses the file's model config first, to
# pick a tokenizer class, and refuses an architecture transformers does not model ("GGUF
# model with architecture olmoe is not supported yet"); every other architecture's
# vocabulary goes to the generic fast tokenizer, which reads only the file's tokenizer
# metadata. A file without a chat template takes its family's (`Family.chat_template`).


class HFTokenizer(Protocol):
    """What `Tokenizer` uses of transformers' tokenizers (and `VocabTokenizer` provides)."""

    chat_template: str | None
    eos_token_id: int | None

    @property
    def special_tokens_map(self) -> dict[str, Any]: ...
    def __call__(self, text: str, add_special_tokens: bool = True) -> Any: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...
    def get_vocab(self) -> dict[str, int]: ...
    def __len__(self) -> int: ...


class VocabTokenizer:
    """A GGUF file's converted vocabulary through the tokenizers library: the same ids and
    text as transformers' fast tokenizer over the same file (its encode and decode are
    this library's, with the special tokens of its config), without transformers."""

    def __init__(
        self, rust: RustTokenizer, specials: dict[str, str], chat_template: str | None
    ) -> None:
        self.rust, self.chat_template = rust, chat_template
        self.special_tokens_map = specials
        eos = specials.get("eos_token")
        self.eos_token_id = None if eos is None else rust.token_to_id(eos)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        # encode_batch lets go of the GIL while it works (encode holds it: a prompt of
        # megabytes stopped every other thread of the host for seconds); the same ids.
        (encoding,) = self.rust.encode_batch([text], add_special_tokens=add_special_tokens)
        return {"input_ids": encoding.ids}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.rust.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.rust.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.rust.get_vocab_size(with_added_tokens=True)


class Tokenizer:
    """Text ↔ token ids, special tokens and the chat template of one model."""

    def __init__(
        self, hf: HFTokenizer, eos_token_ids: Sequence[int], where: str = "the model"
    ) -> None:
        self.hf, self.where = hf, where
        self.eos_token_ids = frozenset(eos_token_ids) | (
            {hf.eos_token_id} if hf.eos_token_id is not None else set()
        )
        self._compiled: tuple[str, ChatTemplate] | None = None
        self._special_ids: frozenset[int] | None = None
        if hf.chat_template:
            self._chat_template()  # a template that does not compile fails the load

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=True)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)

    def decode_keeping(self, token_ids: list[int], kept: frozenset[int]) -> str:
        """`decode`, but the ``kept`` special tokens written out as their text."""
        if self._special_ids is None:
            self._special_ids = self._special_token_ids()
        dropped = self._special_ids - kept
        shown = [t for t in token_ids if t not in dropped]
        return self.hf.decode(shown, skip_special_tokens=False)

    def _special_token_ids(self) -> frozenset[int]:
        """Every special token's id (a GGUF vocabulary's, read by the tokenizers library,
        has no transformers wrapper to ask)."""
        rust = getattr(self.hf, "rust", None)
        if rust is not None:
            added = rust.get_added_tokens_decoder().items()
            return frozenset(i for i, token in added if token.special)
        added = self.hf.added_tokens_decoder.items()  # type: ignore[attr-defined]
        special = {i for i, token in added if token.special}
        return frozenset(special | set(self.hf.all_special_ids))  # type: ignore[attr-defined]

    def definition(self) -> str:
        """The tokenizers library's JSON definition of this tokenizer (what constrained
        decoding builds its view of the vocabulary from)."""
        rust = getattr(self.hf, "rust", None) or getattr(self.hf, "backend_tokenizer", None)
        if rust is None:
            raise RequestError(
                f"{self.where} has no fast (tokenizers-library) tokenizer, which structured "
                "output and token healing need"
            )
        return rust.to_str()

    def encode_plain(self, text: str) -> list[int]:
        """``text``'s tokens alone: no BOS or other special token added."""
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
        template: str | None = None,
    ) -> list[int]:
        return self.encode_plain(self.render_chat(messages, True, tools, variables, template))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
        template: str | None = None,
    ) -> str:
        """The chat template's text for ``messages`` (and the ``tools`` they may call:
        only where given, as templates test whether it is defined); ``variables``: more
        of the template's variables (``enable_thinking``, ``reasoning_effort``), over the
        special tokens' names; ``template``: a request's own template instead of the
        model's (`request_template`)."""
        if not self.hf.chat_template and template is None:
            raise RequestError(
                "this model has no chat template; use generate() with a "
                "formatted prompt instead of chat()"
            )
        given = {k: v for k, v in self.hf.special_tokens_map.items() if isinstance(v, str)}
        given.update(variables or {})
        if tools is not None:
            given["tools"] = tools
        compiled = self._chat_template() if template is None else request_template(template)
        return compiled.render(messages, add_generation_prompt=add_generation_prompt, **given)

    def _chat_template(self) -> ChatTemplate:
        """The template compiled (again only if someone set a new one)."""
        source = self.hf.chat_template
        if self._compiled is None or self._compiled[0] != source:
            self._compiled = (source, ChatTemplate(source, self.where))
        return self._compiled[1]


def load_text_tokenizer(model_dir: Path, eos_token_ids: Sequence[int]) -> Tokenizer:
    from transformers import AutoTokenizer  # half a second to import: only where needed

    try:
        hf = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # the tokenizers library raises bare Exceptions on bad files
        raise ModelFileError(
            f"{model_dir}: cannot load the tokenizer: {type(exc).__name__}: {exc}"
        ) from exc
    return Tokenizer(hf, eos_token_ids, str(model_dir))


def converted_before(gguf_path: Path) -> bool:
    """Whether the GGUF file's tokenizer is converted already (cached)."""
    return (cache_dir("tokenizers") / _cache_key(gguf_path) / "tokenizer.json").exists()


def gguf_tokenizer_dir(gguf_path: Path) -> Path:
    """The directory holding a GGUF file's tokenizer as transformers saves it (converted
    on first use, then cached): what libraries that want a transformers tokenizer read."""
    cached = cache_dir("tokenizers") / _cache_key(gguf_path)
    if not (cached / "tokenizer.json").exists():
        _convert(gguf_path, cached)
    return cached


def load_gguf_tokenizer(
    gguf_path: Path, architecture: str, eos_token_ids: Sequence[int]
) -> Tokenizer:
    hf = _load_converted(gguf_tokenizer_dir(gguf_path))
    fallback = family(architecture).chat_template
    if not hf.chat_template and fallback:
        hf.chat_template = fallback
        log.info(
            "tokenizer.chat_template_fallback",
            architecture=architecture,
            reason="the GGUF file carries no chat template",
        )
    return Tokenizer(hf, eos_token_ids, str(gguf_path))


def _load_converted(directory: Path) -> VocabTokenizer:
    """The saved conversion, read by the tokenizers library: the same ids as the
    model-specific class transformers would pick."""
    config = json.loads((directory / "tokenizer_config.json").read_text())
    specials = {
        key: value["content"] if isinstance(value, dict) else value
        for key, value in config.items()
        if key.endswith("_token") and value is not None
    }
    rust = _read_quick(directory)
    template = directory / "chat_template.jinja"
    chat_template = None
    if template.exists():
        chat_template = template.read_text()
    elif isinstance(config.get("chat_template"), str):
        chat_template = config["chat_template"]
    return VocabTokenizer(rust, specials, chat_template)


# The quick form of a saved conversion: the tokenizers library's own compact JSON with a
# BPE model's merges written "a b" (a string each, the library's older spelling) instead
# of ["a", "b"]. The library turns every JSON array into a tree of values before it builds
# the model; on the default model's 515k merges the pairs cost 0.15-0.2 s of the parse
# and 190 MB of its peak. A space inside a token would make "a b" ambiguous, so such a
# vocabulary keeps its pairs. The vocabulary goes in the byte order of its strings, the
# order of the sorted map the library reads it into first (~5% less of the parse). The
# name holds what the form depends on (this format, the library's version, the saved
# conversion's size and time) and the file's CRC-32.
_QUICK_FORMAT = 2


def _read_quick(directory: Path) -> RustTokenizer:
    """The saved conversion in ``directory``, parsed from its quick form (made from
    tokenizer.json and checked against it on first use; a damaged one is made again)."""
    key = _quick_key(directory)
    saved = directory / "tokenizer.json"
    if _refusal(directory, key).exists():  # tried once: this conversion has none
        return _parse_saved(saved, directory)
    for found in sorted(directory.glob(f"tokenizer.quick-{key}.*.json")):
        rust = _parse_quick(found)
        if rust is not None:
            return rust
    rust = _parse_saved(saved, directory)
    _write_quick(rust, directory, key)
    return rust


def _refusal(directory: Path, key: str) -> Path:
    """The mark left where a conversion's quick form did not parse back to it."""
    return directory / f"tokenizer.quick-{key}.none"


def _quick_key(directory: Path) -> str:
    saved = directory / "tokenizer.json"
    try:
        stat = saved.stat()
    except OSError as exc:
        raise ModelFileError(
            f"{saved}: the cached conversion cannot be read ({exc}); "
            f"delete {directory} to convert again"
        ) from None
    identity = f"{_QUICK_FORMAT}:{tokenizers.__version__}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def _parse_quick(path: Path) -> RustTokenizer | None:
    """The quick form at ``path``, or None (and the file removed) where its bytes do not
    match the CRC-32 in its name or the library cannot parse them."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        data, problem = b"", f"cannot be read: {exc}"
    else:
        problem = _quick_problem(path, data)
    if problem is None:
        try:
            return RustTokenizer.from_buffer(data)
        except Exception as exc:  # the library raises bare Exceptions on a damaged file
            problem = f"{type(exc).__name__}: {exc}"
    try:
        path.unlink(missing_ok=True)
        action = "removed; parsed from tokenizer.json and written again"
    except OSError as exc:
        action = f"cannot be removed ({exc}); parsed from tokenizer.json"
    log.warning("tokenizer.quick_form_damaged", file=str(path), problem=problem, action=action)
    return None


def _quick_problem(path: Path, data: bytes) -> str | None:
    if f"{zlib.crc32(data):08x}" != path.name.split(".")[-2]:
        return "its CRC-32 does not match its name"
    return None


def _parse_saved(saved: Path, directory: Path) -> RustTokenizer:
    try:
        return RustTokenizer.from_file(str(saved))
    except Exception as exc:  # the library raises bare Exceptions on a damaged file
        raise ModelFileError(
            f"{saved}: the cached conversion cannot be read "
            f"({type(exc).__name__}: {exc}); delete {directory} to convert again"
        ) from exc


def _quick_form(rust: RustTokenizer) -> bytes:
    """``rust``'s definition as the quick form's bytes: merges as "a b" strings where
    no merged token holds a space, else as the library writes them."""
    definition = json.loads(rust.to_str())
    model = definition.get("model") or {}
    merges = model.get("merges")
    if model.get("type") == "BPE" and merges and _spaceless_pairs(merges):
        model["merges"] = [f"{left} {right}" for left, right in merges]
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        model["vocab"] = dict(sorted(vocab.items(), key=lambda item: item[0].encode()))
    return json.dumps(definition, ensure_ascii=False, separators=(",", ":")).encode()


def _spaceless_pairs(merges: list[Any]) -> bool:
    return all(
        isinstance(m, list) and len(m) == 2 and " " not in m[0] and " " not in m[1] for m in merges
    )


def _write_quick(rust: RustTokenizer, directory: Path, key: str) -> None:
    """Write the quick form of ``rust`` if the library parses it back to the very same
    definition, else a mark that it has none (tokenizer.json is then read, as before);
    a cache that cannot be written costs speed only, so it is logged."""
    data = _quick_form(rust)
    problem = _round_trip_problem(rust, data)
    target = directory / f"tokenizer.quick-{key}.{zlib.crc32(data):08x}.json"
    if problem is not None:
        log.warning(
            "tokenizer.quick_form_refused",
            directory=str(directory),
            problem=problem,
            action="tokenizer.json is read, as the quick form's absence is marked",
        )
        target, data = _refusal(directory, key), b""
    try:
        _write_whole(data, target)
    except OSError as exc:
        log.warning("tokenizer.quick_form_not_written", file=str(target), error=str(exc))
        return
    log.info("tokenizer.quick_form_written", file=str(target), bytes=len(data))


def _round_trip_problem(rust: RustTokenizer, data: bytes) -> str | None:
    """Why ``data`` is not ``rust``'s definition once the library parses it, or None."""
    try:
        back = RustTokenizer.from_buffer(data)
    except Exception as exc:  # the library raises bare Exceptions on what it cannot read
        return f"it does not parse: {type(exc).__name__}: {exc}"
    if back.to_str() != rust.to_str():
        return "it parses to another definition than the saved conversion"
    return None


def _write_whole(data: bytes, target: Path) -> None:
    """``target`` holds all of ``data`` or does not exist: a reader never sees a part."""
    handle, staging = tempfile.mkstemp(dir=target.parent, prefix=".quick-")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(staging, target)
    finally:
        Path(staging).unlink(missing_ok=True)


def _convert(gguf_path: Path, target: Path) -> None:
    """transformers' GGUF vocabulary conversion (slow: seconds per 100k tokens), saved."""
    log.info(
        "tokenizer.converting",
        file=str(gguf_path),
        note="first load of this file only; the result is cached",
    )
    converter = _vocabulary_converter(GGUFFile(gguf_path).architecture)
    try:
        hf = converter.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as exc:  # transformers' GGUF conversion raises whatever odd metadata trips
        raise ModelFileError(
            f"{gguf_path}: cannot build a tokenizer from the file's vocabulary: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        hf.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        if not (target / "tokenizer.json").exists():  # not a concurrent conversion's win
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _vocabulary_converter(architecture: str) -> Any:
    """The transformers class that converts a GGUF vocabulary of ``architecture``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    found = family_of_gguf(architecture)
    if found is not None and found.gguf_auto_tokenizer:
        return AutoTokenizer
    return PreTrainedTokenizerFast


def _cache_key(path: Path) -> str:
    stat = path.stat()
    identity = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:32]
