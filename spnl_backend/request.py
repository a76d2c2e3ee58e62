"""What a caller may ask for, checked before it reaches the engine.

Every check raises `RequestError` naming the parameter, the value and what is accepted,
so a bad request fails in its caller's thread and never inside a step that other
requests share.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ContextLengthError, RequestError, shown
from .memory import MIB
from .pic.layout import PicPrompt
from .plain import check_text, is_bool, plain_float, plain_int, plain_str, read_once
from .sampling import Adapters, SamplingParams

MAX_SEED = 2**64 - 1  # what torch's generators take
PromptIds = list[int] | PicPrompt  # a checked prompt: token ids, or a PIC prompt


def sampling_params(
    max_tokens: int | None = None,
    temperature: float = 0.6,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    *,
    vocab_size: int | None = None,
    **options: object,
) -> SamplingParams:
    """Validated sampling parameters (a bad one is a `RequestError` naming it).

    Each value is first copied to a plain int, float or str (so a subclass cannot change
    its mind between the check and the use), then checked. Any temperature > 0 samples;
    one so small that dividing the logits by it would overflow gives the limit of the
    distribution (the tied largest logits). ``options``: the names in `OPTION_NAMES`
    (penalties, filters, log-probabilities, an output constraint, token healing);
    ``vocab_size`` bounds the token ids they name (unchecked where None).
    """
    reject_unknown({k: v for k, v in options.items() if k not in OPTION_NAMES})
    tokens = None if max_tokens is None else plain_int(max_tokens)
    if max_tokens is not None and (tokens is None or tokens < 0):
        raise _bad("max_tokens", max_tokens, "an integer >= 0 (0 or None: until EOS or the end)")
    heat = plain_float(temperature)
    if heat is None or heat < 0:
        raise _bad("temperature", temperature, "a finite number >= 0 (0 is greedy)")
    mass = plain_float(top_p)
    if mass is None or not 0 < mass <= 1:
        raise _bad("top_p", top_p, "a number in (0, 1]")
    k = plain_int(top_k)
    if k is None or k < 0:
        raise _bad("top_k", top_k, "an integer >= 0 (0 disables it)")
    plain_seed = None if seed is None else plain_int(seed)
    if seed is not None and (plain_seed is None or not 0 <= plain_seed <= MAX_SEED):
        raise _bad("seed", seed, "None or an integer from 0 to 2**64 - 1")
    return SamplingParams(
        max_tokens=tokens or None,
        temperature=heat,
        top_p=mass,
        top_k=k,
        seed=plain_seed,
        stop=stop_strings(stop),
        **_options(options, vocab_size),
    )


SAMPLING_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
CONSTRAINT_NAMES = ("response_format", "json_schema", "regex", "grammar", "choice")
OPTION_NAMES = (
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    *CONSTRAINT_NAMES,
    "token_healing",
    "keep_stop",
    "speculative",
    "adapter",
    "adapter_scale",
    "adapters",
)
MAX_TOP_LOGPROBS = 20
MAX_ADAPTERS = 64  # LoRA adapters one request may name
MAX_SPECULATIVE = 256  # proposed tokens per step a request may allow
MAX_LOGIT_BIAS = 4096  # entries
MAX_STOP_TOKEN_IDS = 1024
# Every stop string is looked for after every token, on the engine's thread: a request's
# list is bounded so that it cannot slow the others (100,000 strings made a neighbour's
# request 3.6x slower).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 16384  # all of a request's stop strings together


def _options(options: dict[str, object], vocab_size: int | None) -> dict[str, object]:
    """The checked ``options``, as `SamplingParams` fields (those not given left out)."""
    from .constrain.spec import constraint_spec

    checked: dict[str, object] = {}
    for name, (low, high, expected) in _RANGES.items():
        if options.get(name) is not None:
            value = plain_float(options[name])
            if value is None or not low <= value <= high:
                raise _bad(name, options[name], expected)
            checked[name] = value
    for name in ("ignore_eos", "logprobs", "token_healing", "keep_stop"):
        if options.get(name) is not None:
            checked[name] = _plain_bool(options[name], name)
    top = options.get("top_logprobs")
    if top is not None:
        count = plain_int(top)
        if count is None or not 0 <= count <= MAX_TOP_LOGPROBS:
            raise _bad("top_logprobs", top, f"an integer from 0 to {MAX_TOP_LOGPROBS}")
        if count and not checked.get("logprobs"):
            raise RequestError("top_logprobs needs logprobs=True")
        checked["top_logprobs"] = count
    if options.get("speculative") is not None:
        checked["speculative"] = _speculative(options["speculative"])
    adapters = _adapters(options.get("adapter"), options.get("adapter_scale"))
    if options.get("adapters") is not None:
        if adapters:
            raise RequestError("adapter and adapters name a request's adapters twice; give one")
        adapters = adapter_list(options["adapters"])
    if adapters:
        checked["adapters"] = adapters
    if options.get("logit_bias") is not None:
        checked["logit_bias"] = _logit_bias(options["logit_bias"], vocab_size)
    if options.get("stop_token_ids") is not None:
        checked["stop_token_ids"] = _stop_token_ids(options["stop_token_ids"], vocab_size)
    spec = constraint_spec(**{name: options.get(name) for name in CONSTRAINT_NAMES})
    if spec is not None:
        checked["constraint"] = spec
        for clash in ("ignore_eos", "token_healing"):
            if checked.get(clash):
                raise RequestError(
                    f"{clash}=True cannot be combined with {spec.kind.replace('_', ' ')} output: "
                    + _CLASHES[clash]
                )
    return checked


_RANGES = {
    "min_p": (0.0, 1.0, "a number in [0, 1] (0 disables it)"),
    "presence_penalty": (-2.0, 2.0, "a number in [-2, 2] (0 disables it)"),
    "frequency_penalty": (-2.0, 2.0, "a number in [-2, 2] (0 disables it)"),
    # Not near 0: a logit multiplied by 1/1e-300 is infinite, and no token can be drawn.
    "repetition_penalty": (0.01, 100.0, "a number in [0.01, 100] (1 disables it)"),
}
_CLASHES = {
    "ignore_eos": "the constraint ends the output with EOS once it is complete",
    "token_healing": "the constraint applies from the completion's first character",
}


def _logit_bias(value: object, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (ids as ints or, as JSON has them, digit strings), each bias
    in [-100, 100], added to the logit."""
    expected = (
        f"a dict of at most {MAX_LOGIT_BIAS} token ids"
        + ("" if vocab_size is None else f" (0 to {vocab_size - 1})")
        + " to numbers in [-100, 100]"
    )
    if not isinstance(value, dict):
        raise _bad("logit_bias", value, expected)
    try:
        items = list(dict.items(value))
    except Exception:
        raise _bad("logit_bias", value, expected) from None
    if len(items) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", value, expected)
    biases: dict[int, float] = {}
    for key, bias in items:
        token = plain_int(key)
        text = plain_str(key)
        if token is None and text and len(text) <= 12 and text.isascii() and text.isdigit():
            token = int(text)
        amount = plain_float(bias)
        if (
            token is None
            or token < 0
            or (vocab_size is not None and token >= vocab_size)
            or amount is None
            or not -100 <= amount <= 100
        ):
            raise RequestError(f"logit_bias entry {shown(key)}: {shown(bias)}: expected {expected}")
        if token in biases:
            raise RequestError(f"logit_bias names token {token} twice; give each token once")
        biases[token] = amount
    return tuple(sorted(biases.items()))


def _stop_token_ids(value: object, vocab_size: int | None) -> frozenset[int]:
    items = read_once(value, list | tuple)
    ids = [] if items is None else [plain_int(item) for item in items]
    bound = "" if vocab_size is None else f" from 0 to {vocab_size - 1}"
    if (
        items is None
        or len(ids) > MAX_STOP_TOKEN_IDS
        or any(i is None or i < 0 or (vocab_size is not None and i >= vocab_size) for i in ids)
    ):
        raise _bad(
            "stop_token_ids", value, f"a list of at most {MAX_STOP_TOKEN_IDS} token ids{bound}"
        )
    return frozenset(ids)  # type: ignore[arg-type]


def _speculative(value: object) -> int | None:
    """``speculative``: True (the backend's speculation), False (none), or the most tokens
    proposed per step (0 is none)."""
    if is_bool(value):
        return None if value else 0
    count = plain_int(value)
    if count is None or not 0 <= count <= MAX_SPECULATIVE:
        raise _bad(
            "speculative",
            value,
            f"true (the backend's speculative decoding), false (none), or an integer from 0 "
            f"to {MAX_SPECULATIVE} (the most tokens proposed per step; 0 is none)",
        )
    return count


def _adapters(name: object, factor: object) -> Adapters:
    """``adapter`` and ``adapter_scale``: one adapter at a factor (1: as trained)."""
    if name is None:
        if factor is not None:
            raise RequestError("adapter_scale needs an adapter")
        return ()
    if not isinstance(name, str) or not name:
        raise _bad("adapter", name, "the name of a loaded LoRA adapter, or None")
    return adapter_set([(str(name), 1.0 if factor is None else factor)], "adapter_scale")


_ADAPTERS_ACCEPTED = (
    "a LoRA adapter's name, a list of names and (name, scale) pairs, or a dict of "
    "name: scale (scales from -100 to 100; 1: as trained)"
)


def adapter_list(value: object) -> Adapters:
    """``adapters``: a name, a list of names and ``(name, scale)`` pairs, or a dict of
    name: scale (`adapter_set`)."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):
        value = list(value.items())
    if not isinstance(value, (list, tuple)):
        raise _bad("adapters", value, _ADAPTERS_ACCEPTED)
    if len(value) > MAX_ADAPTERS:  # before reading them
        raise RequestError(f"adapters: {len(value)} adapters; at most {MAX_ADAPTERS}")
    entries = []
    for entry in value:
        if isinstance(entry, str):
            entry = (entry, 1.0)
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise _bad("adapters", entry, _ADAPTERS_ACCEPTED)
        entries.append((entry[0], entry[1]))
    return adapter_set(entries, "adapters")


def adapter_set(entries: list[tuple[object, object]], name: str) -> Adapters:
    """LoRA adapters and their factors as `SamplingParams.adapters`: by name, those at 0
    left out (they add nothing); a name twice, a scale out of range, or more than
    `MAX_ADAPTERS` is a `RequestError` naming the option ``name``."""
    if len(entries) > MAX_ADAPTERS:
        raise RequestError(f"{name}: {len(entries)} adapters; at most {MAX_ADAPTERS}")
    chosen: dict[str, float] = {}
    for adapter, factor in entries:
        if not isinstance(adapter, str) or not adapter:
            raise _bad(name, adapter, "the name of a loaded LoRA adapter")
        value = plain_float(factor)
        if value is None or not -100.0 <= value <= 100.0:
            raise _bad(name, factor, "a scale from -100 to 100 (1: as trained)")
        if adapter in chosen:
            raise RequestError(f"{name}: the adapter {adapter!r} is named twice")
        chosen[str(adapter)] = value
    return tuple(sorted((a, f) for a, f in chosen.items() if f != 0.0))


def _plain_bool(value: object, name: str) -> bool:
    if is_bool(value):
        return bool(value)
    raise _bad(name, value, "True or False")


def reject_unknown(unknown: dict[str, object]) -> None:
    """A keyword that is not a parameter is a `RequestError`, not a silent no-op."""
    if unknown:
        raise RequestError(
            "unknown parameter(s) "
            + ", ".join(map(shown, sorted(unknown)))
            + "; accepted: "
            + ", ".join((*SAMPLING_NAMES, *OPTION_NAMES))
        )


def stop_strings(stop: object) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings: a string, or a list or tuple of them
    (read once, each copied to a plain str)."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else read_once(stop, list | tuple) or [None]
    if len(items) > MAX_STOP_STRINGS:
        raise RequestError(
            f"stop: {len(items)} strings; at most {MAX_STOP_STRINGS} are taken (each is "
            "looked for after every token)"
        )
    stops = tuple(plain_str(item) for item in items)
    if not all(stops):
        raise _bad("stop", stop, "a non-empty string or a list of them")
    total = sum(len(text) for text in stops)  # type: ignore[arg-type]
    if total > MAX_STOP_CHARS:
        raise RequestError(
            f"stop: {total:,} characters in all; at most {MAX_STOP_CHARS:,} are taken"
        )
    return tuple(check_text(text, "stop") for text in stops)  # type: ignore[arg-type]


def check_prompt(prompt: object) -> str:
    """``prompt`` as a plain, non-empty str that can be encoded as UTF-8."""
    text = plain_str(prompt)
    if text is None:
        raise RequestError(f"a prompt must be a string, not {type(prompt).__name__}")
    if not text:
        raise RequestError("the prompt is empty")
    return check_text(text, "the prompt")


def prompt_list(prompts: object) -> list[str]:
    """A batch's prompts: a non-empty list or tuple of prompt strings."""
    items = read_once(prompts, list | tuple)
    if not items:
        raise RequestError(
            "expected a prompt string or a non-empty list of prompt strings, "
            f"not {_describe(prompts)}"
        )
    return [check_prompt(p) for p in items]


def token_id_prompts(token_ids: object, vocab_size: int) -> tuple[list[list[int]], bool]:
    """``prompt_token_ids`` as plain lists of ids within the vocabulary: one list of ids
    (then True) or a non-empty list of them (then False)."""
    items = read_once(token_ids, list | tuple)
    if not items:
        raise _bad(
            "prompt_token_ids", token_ids, "a non-empty list of token ids, or a list of such lists"
        )
    if all(isinstance(item, list | tuple) for item in items):
        return [
            checked_token_ids(item, vocab_size, f"prompt_token_ids[{i}]")
            for i, item in enumerate(items)
        ], False
    return [checked_token_ids(token_ids, vocab_size, "prompt_token_ids")], True


def checked_token_ids(value: object, vocab_size: int, name: str) -> list[int]:
    """One non-empty list of token ids within the vocabulary, named ``name`` in errors."""
    items = read_once(value, list | tuple) or []
    ids = [plain_int(item) for item in items]
    if not ids or any(i is None or not 0 <= i < vocab_size for i in ids):
        raise _bad(name, value, f"a non-empty list of token ids from 0 to {vocab_size - 1}")
    return ids  # type: ignore[return-value]


@dataclass(frozen=True)
class CacheRoom:
    """What sizes a paged KV cache, so that a prompt it cannot hold is told the budget that
    would hold it: the budget's kind (`KvBudget.kind`), the block size, the bytes of K and V
    per token (None where a compression method keeps its own records) and the model's own
    context, past which no budget helps."""

    budget_kind: str
    block_size: int
    bytes_per_token: int | None
    model_context: int
    # The sliding-window layers' own pool, where they have one: their share of
    # ``bytes_per_token``, held for at most ``window_tokens`` tokens whatever the budget.
    window_bytes_per_token: int = 0
    window_tokens: int = 0

    def nbytes(self, tokens: int) -> int:
        """The KV cache's bytes for a budget of ``tokens`` (``bytes_per_token`` known)."""
        assert self.bytes_per_token is not None
        windowed = min(tokens, self.window_tokens) * self.window_bytes_per_token
        return tokens * (self.bytes_per_token - self.window_bytes_per_token) + windowed

    def remedy(self, prompt_tokens: int) -> str:
        """The budget that holds ``prompt_tokens`` and one completion token, in words."""
        tokens = -(-(prompt_tokens + 1) // self.block_size) * self.block_size
        if tokens > self.model_context:
            return f"the model's context holds {self.model_context}; shorten it"
        variable = f"MISTRALRS_PAGED_ATTN_{self.budget_kind.upper()}"
        if self.bytes_per_token is None:
            return f"raise MISTRALRS_PAGED_ATTN_CONTEXT_LEN to at least {tokens} or shorten it"
        mb = -(-self.nbytes(tokens) // MIB)
        cost = f"{mb:,} MB of KV cache at {self.bytes_per_token:,} bytes per token"
        if self.window_tokens:
            full = self.bytes_per_token - self.window_bytes_per_token
            cost = (
                f"{mb:,} MB of KV cache: {full:,} bytes per token, and the sliding-window "
                f"layers' {self.window_bytes_per_token:,} for at most {self.window_tokens:,} "
                "tokens"
            )
        if self.budget_kind == "memory_mb":
            return f"raise {variable} to at least {mb} ({tokens} tokens) or shorten it"
        if self.budget_kind == "memory_fraction":
            return (
                f"raise {variable} until the cache holds {tokens} tokens ({cost}), set "
                f"MISTRALRS_PAGED_ATTN_CONTEXT_LEN={tokens} instead, or shorten it"
            )
        return f"raise {variable} to at least {tokens} ({cost}) or shorten it"


# More characters than a token takes: a text of more than this many per token of the
# context cannot fit, and is refused before it is tokenized (which takes a core a second a
# megabyte).
MAX_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class ContextLimit:
    """The tokens a sequence holds, prompt and completion together (``max_model_len``),
    and, where that is the whole paged KV cache's budget rather than the model's context,
    what sizes that cache (``room``: it says what would let a longer prompt run)."""

    max_model_len: int
    room: CacheRoom | None = None

    @property
    def max_chars(self) -> int:
        return MAX_CHARS_PER_TOKEN * self.max_model_len

    def check_chars(self, chars: int, what: str = "the prompt") -> None:
        """Refuse, before it is tokenized, a text of more characters than the context's
        tokens could hold."""
        if chars > self.max_chars:
            raise ContextLengthError(
                f"{what} has {chars:,} characters: more than {self.max_model_len:,} tokens "
                f"of at most {MAX_CHARS_PER_TOKEN} characters each hold, before it is "
                "tokenized; shorten it"
            )

    def check(self, ids: list[int]) -> list[int]:
        """``ids``, where a completion of them fits; else a `ContextLengthError`."""
        if len(ids) >= self.max_model_len:
            if self.room is not None:
                holder = "the whole paged KV cache (the MISTRALRS_PAGED_ATTN_* budget)"
                remedy = self.room.remedy(len(ids))
            else:
                holder, remedy = "the model's context", "shorten it"
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens, but {holder} holds "
                f"{self.max_model_len} (prompt and completion together); {remedy}"
            )
        return ids


def check_messages(
    messages: object, where: str = "messages", offset: int = 0
) -> list[dict[str, object]]:
    """The chat messages as plain dicts, their ``role`` and ``content`` plain strings;
    errors name message ``i`` as ``where[offset + i]``."""
    items = read_once(messages, list)
    if not items:
        raise RequestError(f"{where} must be a non-empty list of {{'role', 'content'}} dicts")
    checked = []
    for index, message in enumerate(items):
        name = f"{where}[{offset + index}]"
        fields = _message_fields(message)
        if fields is None:
            raise RequestError(
                f"{name} = {shown(message)}: expected a dict with string 'role' and 'content'"
            )
        role, content = fields
        check_text(role, f"{name}['role']")
        check_text(content, f"{name}['content']")
        checked.append({**dict.copy(message), "role": role, "content": content})
    return checked


def _message_fields(message: object) -> tuple[str, str] | None:
    if not isinstance(message, dict):
        return None
    try:
        role, content = dict.get(message, "role"), dict.get(message, "content")
    except Exception:  # an unhashable or hostile key lookup
        return None
    role, content = plain_str(role), plain_str(content)
    return None if role is None or content is None else (role, content)


def _bad(name: str, value: object, expected: str) -> RequestError:
    return RequestError(f"{name}={shown(value)}: expected {expected}")


def _describe(value: object) -> str:
    return f"{type(value).__name__} {shown(value)}"
