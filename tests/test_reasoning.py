"""Reasoning separated from the answer: the formats read from chat templates and chosen by
name, each parser on whole outputs and on the same outputs streamed in random pieces."""

import random

import pytest

from spnl_backend.errors import RequestError
from spnl_backend.reasoning import (
    Reasoning,
    ReasoningDelta,
    check_effort,
    detect_format,
    parse_reasoning_format,
    starts_inside,
)
from spnl_backend.reasoning.parsers import held

WEATHER_CALL = (
    "<|channel|>analysis<|message|>The user wants Paris' weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
CASES = [
    # (format, output starts inside the reasoning, output, reasoning, answer)
    (
        "think",
        False,
        "<think>\nLet me add.\n2+2=4\n</think>\n\nIt is 4.",
        "Let me add.\n2+2=4",
        "It is 4.",
    ),
    ("think", False, "  <think>x</think>y", "x", "y"),
    ("think", False, "It is 4, no <think> here.", "", "It is 4, no <think> here."),
    ("think", False, "<thinking is not a tag", "", "<thinking is not a tag"),
    ("think", True, "\nhmm </thin k>\n</think>\n\nFour.", "hmm </thin k>", "Four."),
    ("think", True, "cut short, still thinking", "cut short, still thinking", ""),
    ("think", False, "<think>\n\n</think>\n\nNo thoughts.", "", "No thoughts."),
    ("think", False, "<think>a</think>b </think> c", "a", "b </think> c"),
    (
        "granite",
        False,
        "<think>plan</think>\n<response>The answer.</response>",
        "plan",
        "The answer.",
    ),
    ("granite", False, "<think>plan</think>no wrapper", "plan", "no wrapper"),
    (
        "harmony",
        False,
        "<|channel|>analysis<|message|>Think <b>hard</b>.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Four <|x|> is it.<|return|>",
        "Think <b>hard</b>.",
        "Four <|x|> is it.",
    ),
    (
        "harmony",
        False,
        "<|channel|>commentary<|message|>Checking.<|end|><|channel|>final<|message|>Done.",
        "",
        "Checking.Done.",
    ),
    (
        "harmony",
        False,
        "<|channel|>analysis<|message|>only thinking, cut",
        "only thinking, cut",
        "",
    ),
]


def _streamed(reasoning: Reasoning, text: str, rng: random.Random) -> ReasoningDelta:
    parser = reasoning.parser()
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    total = ReasoningDelta()
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        total.add(parser.feed(text[start:end]))
    total.add(parser.finish())
    return total


@pytest.mark.parametrize(("fmt", "inside", "text", "reasoning", "answer"), CASES)
def test_whole_outputs_split(fmt, inside, text, reasoning, answer):
    got = Reasoning(fmt, inside).split(text)
    assert (got.reasoning, got.content) == (reasoning, answer)


@pytest.mark.parametrize(("fmt", "inside", "text", "reasoning", "answer"), CASES)
def test_streamed_in_random_pieces_equals_whole(fmt, inside, text, reasoning, answer):
    rng = random.Random(text)
    for _ in range(30):
        got = _streamed(Reasoning(fmt, inside), text, rng)
        assert (got.reasoning, got.content) == (reasoning, answer)


@pytest.mark.parametrize(("fmt", "inside", "text", "reasoning", "answer"), CASES)
def test_one_character_at_a_time_never_shows_a_partial_marker(fmt, inside, text, reasoning, answer):
    parser = Reasoning(fmt, inside).parser()
    content = ""
    for char in text:
        content += parser.feed(char).content
        assert answer.startswith(content), content  # never something taken back later
    assert content + parser.finish().content == answer


def test_a_harmony_tool_call_is_read_from_commentary():
    got = Reasoning("harmony", calls=True).split(WEATHER_CALL)
    assert got.reasoning == "The user wants Paris' weather."
    assert got.content == ""
    (call,) = got.started
    assert (call.name, call.arguments, call.whole) == ("get_weather", '{"city": "Paris"}', True)
    assert call.id.startswith("call_")
    streamed = _streamed(Reasoning("harmony", calls=True), WEATHER_CALL, random.Random(3))
    assert [(c.name, c.arguments) for c in streamed.started] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert "".join(f for _, f in streamed.arguments) == '{"city": "Paris"}'


def test_a_harmony_call_not_read_as_one_stays_in_the_answer_as_written():
    # No tools offered (or tool_choice none): the call is the answer's text, not dropped.
    call = WEATHER_CALL[WEATHER_CALL.index("<|start|>") :]
    for reasoning in (Reasoning("harmony"), Reasoning("harmony", calls=False)):
        got = reasoning.split(WEATHER_CALL)
        assert (got.reasoning, got.content, got.started) == (
            "The user wants Paris' weather.",
            call,
            [],
        )
        for seed in range(5):
            streamed = _streamed(reasoning, WEATHER_CALL, random.Random(seed))
            assert (streamed.content, streamed.started) == (call, [])
    # The output's first message (opened by the generation prompt), its <|call|> an EOS.
    bare = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}'
    assert Reasoning("harmony").split(bare).content == bare


def test_a_harmony_call_ended_by_its_stop_token_is_whole_at_the_end():
    # <|call|> ends generation as an EOS token: the text stops before it.
    parser = Reasoning("harmony", calls=True).parser()
    parser.feed('<|channel|>commentary to=functions.add<|message|>{"a": 1}')
    parser.finish()
    assert [(c.name, c.arguments, c.whole) for c in parser.calls] == [("add", '{"a": 1}', True)]


def test_no_format_is_all_answer():
    assert Reasoning("none").parser() is None
    assert Reasoning("none").split("<think>x</think>y").content == "<think>x</think>y"


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", "harmony"),
        ("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}", "think"),
        ("<think></think><response></response>", "granite"),
        ("{{ messages }}", "none"),
        (None, "none"),
    ],
)
def test_the_format_is_read_from_the_template(template, fmt):
    assert detect_format(template) == fmt


def test_the_output_starts_inside_where_the_prompt_opens_the_block():
    assert starts_inside("think", "<｜Assistant｜><think>\n")
    assert not starts_inside("think", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_inside("harmony", "<think>")


def test_format_names_and_aliases_are_checked():
    assert parse_reasoning_format("auto") == "auto"
    assert parse_reasoning_format("DeepSeek") == "think"
    assert parse_reasoning_format("gpt-oss") == "harmony"
    with pytest.raises(ValueError, match="expected one of auto, none, think, granite, harmony"):
        parse_reasoning_format("deepthink")


def test_effort_is_low_medium_or_high():
    assert check_effort(None) is None
    assert check_effort("high") == "high"
    with pytest.raises(RequestError, match="reasoning_effort='max': expected 'low'"):
        check_effort("max")


def test_held_is_the_longest_tag_prefix_at_the_end():
    assert held("abc </thi", ("</think>",)) == 5
    assert held("abc <", ("</think>", "<|end|>")) == 1
    assert held("abc", ("</think>",)) == 0
    assert held("</think>", ("</think>",)) == 0  # a whole tag is the caller's to find
