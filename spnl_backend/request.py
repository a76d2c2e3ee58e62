"""What a caller may ask for, checked before it reaches the engine.

Every check raises `RequestError` naming the parameter, the value and what is accepted,
so a bad request fails in its caller's thread and never inside a step that other
requests share.
"""

import math
import numbers
from collections.abc import Sequence
from typing import Any

from .engine.sequence import SamplingParams
from .errors import RequestError

MAX_SEED = 2**64 - 1  # what torch's generators take


def sampling_params(
    max_tokens: int | None = None,
    temperature: float = 0.6,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
) -> SamplingParams:
    """Validated sampling parameters (a bad one is a `RequestError` naming it).

    Any temperature > 0 samples; one so small that dividing the logits by it would
    overflow gives the limit of the distribution (the tied largest logits).
    """
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 0):
        raise RequestError(
            f"max_tokens={_shown(max_tokens)}: expected an integer >= 0 "
            "(0 or None: until EOS or the end of the context)"
        )
    if not _is_number(temperature) or temperature < 0:
        raise RequestError(
            f"temperature={_shown(temperature)}: expected a finite number >= 0 (0 is greedy)"
        )
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise RequestError(f"top_p={_shown(top_p)}: expected a number in (0, 1]")
    if not _is_int(top_k) or top_k < 0:
        raise RequestError(f"top_k={_shown(top_k)}: expected an integer >= 0 (0 disables it)")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise RequestError(f"seed={_shown(seed)}: expected None or an integer from 0 to 2**64 - 1")
    return SamplingParams(
        max_tokens=int(max_tokens) if max_tokens else None,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        seed=None if seed is None else int(seed),
        stop=stop_strings(stop),
    )


SAMPLING_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def reject_unknown(unknown: dict[str, object]) -> None:
    """A keyword that is not a parameter is a `RequestError`, not a silent no-op."""
    if unknown:
        raise RequestError(
            "unknown parameter(s) "
            + ", ".join(map(repr, sorted(unknown)))
            + "; accepted: "
            + ", ".join(SAMPLING_NAMES)
        )


def stop_strings(stop: object) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings: a string, or a list or tuple of them."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop={_shown(stop)}: expected a non-empty string or a list of them")
    for text in stops:
        check_text(text, "stop")
    return tuple(stops)


def check_prompt(prompt: object) -> str:
    if not isinstance(prompt, str):
        raise RequestError(f"a prompt must be a string, not {type(prompt).__name__}")
    if not prompt:
        raise RequestError("the prompt is empty")
    return check_text(prompt, "the prompt")


def prompt_list(prompts: object) -> list[str]:
    """A batch's prompts: a non-empty list or tuple of prompt strings."""
    if not isinstance(prompts, list | tuple) or not prompts:
        raise RequestError(
            "expected a prompt string or a non-empty list of prompt strings, "
            f"not {_describe(prompts)}"
        )
    return [check_prompt(p) for p in prompts]


def check_messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise RequestError(
                f"messages[{i}] = {_shown(message)}: "
                "expected a dict with string 'role' and 'content'"
            )
        check_text(message["content"], f"messages[{i}]['content']")
        check_text(message["role"], f"messages[{i}]['role']")
    return messages


def check_text(text: str, what: str) -> str:
    """``text`` if it can be encoded as UTF-8 (a lone surrogate cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"{what} is not valid Unicode text: {exc.reason} at character {exc.start} "
            f"({text[exc.start : exc.end]!r}); expected text that can be encoded as UTF-8"
        ) from None
    return text


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_number(value: object) -> bool:
    if not isinstance(value, numbers.Real) or _is_bool(value):
        return False
    try:
        return math.isfinite(float(value))
    except (OverflowError, ValueError, TypeError):  # an int too large for a float, say
        return False


def _is_bool(value: object) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's too


def _describe(value: object) -> str:
    return f"{type(value).__name__} {_shown(value)}"


def _shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about caller input (an
    int of 5,000 digits has no repr at all)."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__, or an int past Python's digit limit
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
