"""Parsers for the values of the MISTRALRS_* variables.

Each parser takes what the environment gives (a string) or what code passes (a
native value) and returns the canonical value, or raises `ValueError` whose
message says what is accepted. The caller adds the variable name and the value.
"""

import json
import os
import re
from enum import StrEnum
from typing import Literal

_TRUE = frozenset({"true", "1", "on", "yes"})
_FALSE = frozenset({"false", "0", "off", "no"})
BOOL_SPELLINGS = "true/false, 1/0, on/off, yes/no (any case)"


class IsqType(StrEnum):
    """The GGML weight types that in-situ quantization can produce."""

    Q2K = "Q2K"
    Q3K = "Q3K"
    Q4K = "Q4K"
    Q5K = "Q5K"
    Q6K = "Q6K"
    Q4_0 = "Q4_0"
    Q4_1 = "Q4_1"
    Q5_0 = "Q5_0"
    Q5_1 = "Q5_1"
    Q8_0 = "Q8_0"
    Q8_1 = "Q8_1"


# What mistral.rs picks for `--isq <bits>` on CUDA and CPU.
ISQ_BY_BITS = {
    2: IsqType.Q2K,
    3: IsqType.Q3K,
    4: IsqType.Q4K,
    5: IsqType.Q5K,
    6: IsqType.Q6K,
    8: IsqType.Q8_0,
}
_ISQ_OFF = frozenset({"none", "false", "off", "no"})
_K_QUANT = re.compile(r"Q([2-6])_?K(?:_?[SML])?")
_LEGACY_QUANT = re.compile(r"Q([4-8])_([01])")
ISQ_ACCEPTED = (
    "none/false, "
    + ", ".join(t.value for t in IsqType)
    + " (also spelled Q4_K, q4k, Q4_K_M, Q4_K_S, Q8), or bits "
    + ", ".join(str(b) for b in ISQ_BY_BITS)
)

BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
CACHE_TYPES = ("auto", "f8e4m3", "f16", "f32")
CPU_KERNELS = ("auto", "native", "torch")
# Whose code runs a text model: ours (a family module), transformers' (`loader.transformers_path`).
MODEL_IMPLS = ("auto", "native", "transformers")
CPU_MATMULS = ("auto", "int8", "float32")
CPU_GEMMS = ("auto", "float32", "bfloat16")
DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "f32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
_DEVICE = re.compile(r"(auto|cpu|mps|metal|cuda)(?::(\d+))?")
DEVICE_ACCEPTED = "auto, cpu, cuda, cuda:N, mps (or metal)"


def _text(value: object) -> str:
    return str(value).strip()


def parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(value).lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"expected a boolean: {BOOL_SPELLINGS}")


def parse_paged_attn(value: object) -> bool | Literal["auto"]:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return parse_bool(value)
    except ValueError:
        raise ValueError(f"expected auto or a boolean: {BOOL_SPELLINGS}") from None


def _parse_int(value: object, expected: str) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(expected)
    if isinstance(value, int | float):
        return int(value)
    text = _text(value)
    if not re.fullmatch(r"[+-]?[0-9]+", text):  # not \d: other scripts' digits too
        raise ValueError(expected)
    return int(text)


def parse_block_size(value: object) -> int:
    expected = "expected a power of two from 8 to 256: " + ", ".join(map(str, BLOCK_SIZES))
    size = _parse_int(value, expected)
    if size not in BLOCK_SIZES:
        raise ValueError(expected)
    return size


def parse_prefix_cache_n(value: object) -> int:
    expected = "expected an integer >= 0, or false (0 and false disable prefix caching)"
    if value is False or (isinstance(value, str) and value.strip().lower() == "false"):
        return 0
    count = _parse_int(value, expected)
    if count < 0:
        raise ValueError(expected)
    return count


# Counts and sizes above this are not meant (and would not survive float arithmetic).
MAX_COUNT = 2**53


def parse_positive_int(value: object) -> int:
    expected = f"expected a whole number from 1 to {MAX_COUNT:,}"
    number = _parse_int(value, expected)
    if not 0 < number <= MAX_COUNT:
        raise ValueError(expected)
    return number


MAX_THREADS = 256  # the native kernels' pool: the caller and 255 workers


def parse_num_threads(value: object) -> int | str:
    """``auto`` or a thread count from 1 to `MAX_THREADS`."""
    expected = f"expected auto or a whole number from 1 to {MAX_THREADS}"
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    number = _parse_int(value, expected)
    if not 0 < number <= MAX_THREADS:
        raise ValueError(expected)
    return number


def _parse_float(
    value: object, bottom: float, top: float, open_bottom: bool, expected: str
) -> float:
    """A number from ``bottom`` (excluded where ``open_bottom``) to ``top``."""
    if isinstance(value, bool):
        raise ValueError(expected)
    try:
        if isinstance(value, str) and not _text(value).isascii():
            raise ValueError(expected)  # float() reads other scripts' digits
        number = float(_text(value)) if isinstance(value, str) else float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(expected) from None
    above = number > bottom if open_bottom else number >= bottom
    if not (above and number <= top):
        raise ValueError(expected)
    return number


def _parse_positive_float(value: object, top: float, expected: str) -> float:
    """A number greater than 0 and at most ``top``."""
    return _parse_float(value, 0.0, top, True, expected)


def parse_fraction(value: object) -> float:
    expected = "expected a number greater than 0 and at most 1 (a fraction of free device memory)"
    return _parse_positive_float(value, 1.0, expected)


def parse_share(value: object) -> float:
    """A number from 0 to 1 (0 allowed, unlike `parse_fraction`)."""
    return _parse_float(
        value, 0.0, 1.0, False, "expected a number from 0 to 1 (a fraction; 0: none)"
    )


def parse_isq(value: object) -> IsqType | None:
    if value is None or value is False:
        return None
    if isinstance(value, IsqType):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    text = _text(value)
    if text.lower() in _ISQ_OFF:
        return None
    if text.isdigit():
        if int(text) in ISQ_BY_BITS:
            return ISQ_BY_BITS[int(text)]
        raise ValueError(f"expected {ISQ_ACCEPTED}")
    upper = text.upper()
    if upper == "Q8":
        return IsqType.Q8_0
    if match := _K_QUANT.fullmatch(upper):
        return IsqType(f"Q{match[1]}K")
    if (match := _LEGACY_QUANT.fullmatch(upper)) and upper in IsqType.__members__:
        return IsqType(upper)
    raise ValueError(f"expected {ISQ_ACCEPTED}")


def choice(options: tuple[str, ...]):
    """A parser that accepts one of ``options`` (any case)."""

    def parse(value: object) -> str:
        text = _text(value).lower()
        if text not in options:
            raise ValueError("expected one of: " + ", ".join(options))
        return text

    return parse


parse_cache_type = choice(CACHE_TYPES)


def parse_dtype(value: object) -> str:
    text = _text(value).lower().removeprefix("torch.")
    if text not in DTYPES:
        raise ValueError(
            "expected one of: auto, float32 (f32), float16 (f16, half), bfloat16 (bf16)"
        )
    return DTYPES[text]


def parse_device(value: object) -> str:
    text = _text(value).lower()
    match = _DEVICE.fullmatch(text)
    if not match or (match[2] is not None and match[1] != "cuda"):
        raise ValueError(f"expected one of: {DEVICE_ACCEPTED}")
    return "mps" if match[1] == "metal" else text


def parse_optional_name(value: object) -> str | None:
    if value is None:
        return None
    text = _text(value)
    if not text:
        raise ValueError("expected a model name or path, not an empty string")
    return text


def parse_directory(value: object) -> str | None:
    """A directory's path (``~`` expanded); it need not exist yet, but nothing else may be
    there."""
    text = _text(value).strip()
    if not text:
        return None
    path = os.path.expanduser(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{text!r} exists and is not a directory; expected a directory's path")
    return path


def parse_port(value: object) -> int:
    expected = "expected a TCP port number from 1 to 65535"
    port = _parse_int(value, expected)
    if not 0 < port < 65536:
        raise ValueError(expected)
    return port


def parse_count(value: object) -> int:
    """A whole number >= 0 (an index)."""
    expected = f"expected a whole number from 0 to {MAX_COUNT:,}"
    number = _parse_int(value, expected)
    if not 0 <= number <= MAX_COUNT:
        raise ValueError(expected)
    return number


_HOST_PORT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(\d+)")


def parse_host_port(value: object) -> str:
    expected = "expected host:port (a name or address, then a port from 1 to 65535)"
    text = _text(value)
    match = _HOST_PORT.fullmatch(text)
    if not match or not 0 < int(match[2]) < 65536:
        raise ValueError(expected)
    return text


def parse_seconds(value: object) -> float:
    expected = "expected a number of seconds greater than 0 (at most a day)"
    return _parse_positive_float(value, 86400.0, expected)


_DEVICE_LAYERS = re.compile(r"\d+:\d+(;\d+:\d+)*;?")


def parse_device_layers(value: object) -> tuple[tuple[int, int], ...] | None:
    """``ORD:LAYERS;ORD:LAYERS...`` (mistral.rs's ``--num-device-layers``): that many
    consecutive layers on each device, in order."""
    expected = (
        "expected ORDINAL:LAYERS pairs joined by ';' (for example 0:16;1:16), each device "
        "once, each with at least one layer"
    )
    if value is None:
        return None
    if isinstance(value, tuple | list):
        pairs = tuple(tuple(pair) for pair in value)
    else:
        text = _text(value).replace(" ", "")
        if not _DEVICE_LAYERS.fullmatch(text):
            raise ValueError(expected)
        pairs = tuple(
            tuple(int(n) for n in part.split(":")) for part in text.rstrip(";").split(";")
        )
    if not all(
        len(pair) == 2 and all(isinstance(n, int) and not isinstance(n, bool) for n in pair)
        for pair in pairs
    ):
        raise ValueError(expected)
    ordinals = [ordinal for ordinal, _ in pairs]
    if len(set(ordinals)) != len(ordinals) or any(n < 1 or o < 0 for o, n in pairs):
        raise ValueError(expected)
    return pairs  # type: ignore[return-value]


# Reasoning syntaxes (`reasoning.formats`), with other projects' names for the same ones.
REASONING_FORMATS = ("auto", "none", "think", "granite", "harmony")
REASONING_ALIASES = {
    "deepseek": "think",
    "deepseek_r1": "think",
    "deepseek-r1": "think",
    "qwen3": "think",
    "gpt_oss": "harmony",
    "gpt-oss": "harmony",
    "openai_gptoss": "harmony",
}


def parse_reasoning_format(value: object) -> str:
    """A reasoning format's name (or an accepted alias) → ours."""
    name = _text(value).strip().lower()
    if name in REASONING_FORMATS:
        return name
    if name in REASONING_ALIASES:
        return REASONING_ALIASES[name]
    raise ValueError(
        f"expected one of {', '.join(REASONING_FORMATS)} "
        f"(or the aliases {', '.join(REASONING_ALIASES)})"
    )


def parse_chat_template(value: object) -> str | None:
    """A chat template: a file's path or the Jinja source itself (read and compiled when
    the model loads, where its errors name the line)."""
    if value is None:
        return None
    text = str(value)
    if not text.strip():
        raise ValueError("expected a chat template file's path or Jinja source, not nothing")
    return text


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` may name a LoRA adapter: letters, digits and ``. _ : / -``."""
    return _ADAPTER_NAME.fullmatch(name) is not None


def parse_lora_adapters(value: object) -> str | None:
    """``name=path,name2=path2``: LoRA adapter directories and the names requests choose
    them by, checked and written back in that form (`lora_adapter_list` reads it)."""
    text = _text(value)
    if not text:
        return None
    pairs = [part.strip() for part in text.split(",")]
    seen: set[str] = set()
    for pair in pairs:
        name, sep, path = (piece.strip() for piece in pair.partition("="))
        if not sep or not path or not _ADAPTER_NAME.fullmatch(name):
            raise ValueError(
                f"expected name=path pairs separated by commas (a name of letters, digits "
                f"and . _ : / -), got {pair!r}"
            )
        if name in seen:
            raise ValueError(f"expected each adapter name once, got {name!r} twice")
        seen.add(name)
    return ",".join("=".join(p.strip() for p in pair.partition("=")[::2]) for pair in pairs)


def lora_adapter_list(value: str | None) -> list[tuple[str, str]]:
    """The ``(name, path)`` pairs of a checked `parse_lora_adapters` value."""
    if not value:
        return []
    return [(name, path) for name, _, path in (pair.partition("=") for pair in value.split(","))]


# The chat template's own inputs, which given variables may not replace.
RESERVED_VARIABLES = ("messages", "tools", "add_generation_prompt")


def parse_template_kwargs(value: object) -> str | None:
    """Default chat template variables: a JSON object (``{"enable_thinking": false}``),
    kept as its canonical JSON text (the settings stay hashable)."""
    if value is None:
        return None
    try:
        variables = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise ValueError(f"expected a JSON object of template variables ({exc})") from None
    if not isinstance(variables, dict):
        raise ValueError(
            'expected a JSON object of template variables, such as {"enable_thinking": false}'
        )
    reserved = sorted(set(variables) & set(RESERVED_VARIABLES))
    if reserved:
        raise ValueError(
            f"expected template variables; {reserved[0]!r} is the template's own input, "
            "set by each request"
        )
    return json.dumps(variables, sort_keys=True)
