"""Which reasoning syntax a model writes, known from its chat template or chosen by the
``MISTRALRS_REASONING_FORMAT`` setting (``serve --reasoning-format``).

- ``think``: a ``<think>...</think>`` block before the answer (Qwen3/3.5, QwQ, DeepSeek-R1
  and its distills, SmolLM3); where the template opens the block in the generation
  prompt, the output starts inside it;
- ``granite``: the same block, the answer then wrapped in ``<response>...</response>``
  (Granite 3.x in thinking mode);
- ``harmony``: gpt-oss's channels: ``analysis`` is the reasoning, ``final`` the answer,
  ``commentary`` a preamble or a tool call (``to=functions.NAME``);
- ``none``: no separation: the whole output is the answer;
- ``auto`` (the default): one of the above, read from the chat template.
"""

from ..errors import RequestError, shown

FORMATS = ("auto", "none", "think", "granite", "harmony")
# Other projects' names for the same syntaxes, accepted as spellings of ours.
ALIASES = {
    "deepseek": "think",
    "deepseek_r1": "think",
    "deepseek-r1": "think",
    "qwen3": "think",
    "gpt_oss": "harmony",
    "gpt-oss": "harmony",
    "openai_gptoss": "harmony",
}

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<response>", "</response>"
# gpt-oss's message syntax: <|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>, a
# turn's last message ending in <|return|> (an answer) or <|call|> (a tool call).
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
HARMONY_TAGS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)


def parse_reasoning_format(value: object) -> str:
    """A reasoning format's name (or an accepted alias) → ours; a `ValueError` saying what
    is accepted otherwise."""
    name = value.strip().lower() if isinstance(value, str) else value
    if isinstance(name, str) and name in FORMATS:
        return name
    if isinstance(name, str) and name in ALIASES:
        return ALIASES[name]
    raise ValueError(f"expected one of {', '.join(FORMATS)} (or the aliases {', '.join(ALIASES)})")


def detect_format(template: str | None) -> str:
    """The reasoning syntax a chat template writes: ``harmony``, ``granite``, ``think``, or
    ``none`` where it has none."""
    if not template:
        return "none"
    if CHANNEL in template and MESSAGE in template:
        return "harmony"
    if THINK_CLOSE in template or THINK_OPEN in template:
        return "granite" if RESPONSE_OPEN in template else "think"
    return "none"


def resolve_format(setting: str, template: str | None) -> str:
    """The format in effect: the setting, or for ``auto`` the template's."""
    return detect_format(template) if setting == "auto" else setting


def markers(fmt: str) -> tuple[str, ...]:
    """The texts the parser reads: where one is a special token, decoding must keep it."""
    if fmt == "harmony":
        return HARMONY_TAGS
    if fmt == "granite":
        return (THINK_OPEN, THINK_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
    if fmt == "think":
        return (THINK_OPEN, THINK_CLOSE)
    return ()


def starts_inside(fmt: str, prompt_tail: str) -> bool:
    """Whether the output starts inside the reasoning: the prompt (its last characters are
    enough) ends with the template's opening of the thinking block, as DeepSeek-R1's and
    Qwen3-Thinking's generation prompts do."""
    return fmt in ("think", "granite") and prompt_tail.rstrip().endswith(THINK_OPEN)


def check_effort(value: object, name: str = "reasoning_effort") -> str | None:
    """A ``reasoning_effort`` value (``low``, ``medium``, ``high``), or None where absent."""
    if value is None or value in ("low", "medium", "high"):
        return value  # type: ignore[return-value]
    raise RequestError(f"{name}={shown(value)}: expected 'low', 'medium' or 'high'")
