"""spnl itself as a client: its queries, run in a separate process (spnl holds the GIL
while it runs) against the server, give the Python API's greedy text."""

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
from live_server import MODEL, served_backend

pytest.importorskip("spnl")

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import spnl
    response = asyncio.run(spnl.execute(sys.argv[1]))
    print("\\nRESULT=" + json.dumps(response.data), flush=True)
    """
)


@pytest.fixture(scope="module")
def backend(tiny):
    backend = served_backend(tiny)
    yield backend
    backend.close()


def _execute(live, query: dict) -> str:
    env = {**os.environ, "OPENAI_API_BASE": live.url + "/v1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(query)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.rsplit("RESULT=", 1)[1])


def _g(content: str, max_tokens: int = 12) -> dict:
    model = f"openai/{MODEL}"
    return {
        "g": {
            "model": model,
            "input": {"user": content},
            "max_tokens": max_tokens,
            "temperature": 0,
        }
    }


def _chat(backend, content: str, max_tokens: int = 12) -> str:
    return backend.chat(
        [{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0
    ).text


def test_a_generate_query(live, backend):
    assert _execute(live, _g("The capital")) == _chat(backend, "The capital")


def test_a_repeat_query_is_one_request_with_n(live, backend):
    text = _chat(backend, "Once upon")
    assert _execute(live, {"repeat": {"n": 3, "g": _g("Once upon")["g"]}}) == "\n".join([text] * 3)


def test_a_map_query(live, backend):
    inputs = ["The capital of", "Once upon a", "def add(a, b):"]
    query = {
        "map": {
            "metadata": {"model": f"openai/{MODEL}", "max_tokens": 10, "temperature": 0},
            "inputs": inputs,
        }
    }
    texts = [backend.generate(p, max_tokens=10, temperature=0).text for p in inputs]
    assert _execute(live, query) == "\n".join(t for t in texts if t)


def test_several_queries_at_once(live, backend):
    contents = ["alpha", "beta gamma", "delta", "the end"]
    with ThreadPoolExecutor(len(contents)) as pool:
        results = list(pool.map(lambda c: _execute(live, _g(c)), contents))
    assert results == [_chat(backend, c) for c in contents]


def test_a_plus_query_sends_its_parts_concurrently(live, backend):
    contents = ["first part", "second part", "third"]
    query = {"plus": [_g(c) for c in contents]}
    assert _execute(live, query) == "\n".join(_chat(backend, c) for c in contents)
