"""The server against hostile requests (issue 53): each is refused with a 4xx that names
what it broke, promptly, and legitimate requests of the same shape still pass."""

import json

import pytest
from live_server import MODEL, served_backend
from test_tools import TOOL_TEMPLATE

from spnl_backend.plain import MAX_JSON_DEPTH


@pytest.fixture(scope="module")
def backend(tiny):
    backend = served_backend(tiny, TOOL_TEMPLATE)
    yield backend
    backend.close()


def _nested(depth: int) -> str:
    return "[" * (depth - 1) + "{}" + "]" * (depth - 1)


def _called(path: str, arguments: object) -> dict:
    """A chat whose past assistant turn called ``f`` with ``arguments``, as ``path`` takes it."""
    call = {"function": {"name": "f", "arguments": arguments}}
    result = {"role": "tool", "content": "done"}
    if path.startswith("/v1/"):
        call = {"id": "c1", "type": "function", **call}
        result["tool_call_id"] = "c1"
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        result,
    ]
    limit = {"max_tokens": 1} if path.startswith("/v1/") else {"options": {"num_predict": 1}}
    return {"model": MODEL, "messages": messages, "stream": False, **limit}


# ---- JSON nested too deep, in the body or in a JSON string inside it ---------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_a_past_calls_arguments_nested_too_deep_are_a_400(live, path):
    # 990 levels under 10 KB: once a RecursionError, and a 500.
    deep = json.dumps({"a": json.loads(_nested(MAX_JSON_DEPTH))})
    for arguments in ("[" * 990 + "]" * 990, deep):
        reply = live.post(path, _called(path, arguments))
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert "tool_calls" in message
        assert f"more than {MAX_JSON_DEPTH} deep" in message
    shallow = json.dumps({"a": json.loads(_nested(MAX_JSON_DEPTH - 1))})
    assert live.post(path, _called(path, shallow)).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x"}),
        ("/api/generate", {"model": MODEL, "prompt": "x"}),
        ("/v1/query/execute", {"g": {"model": MODEL, "input": {"user": "x"}}}),
    ],
)
def test_a_body_nested_too_deep_is_a_400_that_names_the_limit(live, path, body):
    deep = {**body, "extra": json.loads(_nested(MAX_JSON_DEPTH))}
    reply = live.post(path, deep)
    assert reply.status_code == 400, reply.text
    assert f"more than {MAX_JSON_DEPTH} deep" in reply.text
    past_the_parser = json.dumps(body)[:-1] + ', "extra": ' + "[" * 5000 + "]" * 5000 + "}"
    reply = live.post(path, None, content=past_the_parser)
    assert reply.status_code == 400, reply.text
