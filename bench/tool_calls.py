"""Tool-call latency: ours and llama.cpp's llama-server, side by side in one run.

    python bench/tool_calls.py --llama-server PATH [--template JINJA] [--gguf GGUF]
        [--threads 2] [--requests 20] [--clients 1 4] [--markdown FILE]

The default model's chat template renders no tools, so the GGUF (default: Gemma 3 270M
Q4_K_M) is first copied with a Hermes-style one by gguf-py's ``gguf_new_metadata``: by
default Qwen 2.5's, read from llama.cpp's source tree beside the built ``llama-server``
(``models/templates/Qwen-Qwen2.5-7B-Instruct.jinja``): the tools listed in ``<tools>``, a
call written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Both servers
read the call syntax from that template: ours as ``spnl-backend serve``, llama.cpp's as
``llama-server --jinja -np 16`` (its parser and grammar generated from the template).

Each request is a streamed chat completion with one tool (a city as a string of at most
24 characters, a unit from an enum), ``tool_choice: "required"``, ``parallel_tool_calls:
false``, ``temperature: 0`` and ``max_tokens: 64``: two earlier turns in which the tool was
called and answered, then a question about the weather in a city (numbered, so that no
two requests share more than the earlier turns). Per engine and client count (each client
its next request as soon as its last is done): the time from sending a request to its
first call's name (the first ``delta.tool_calls``) and to that call's arguments made
whole (they parse), p50 and p99; how many first calls are valid against the tool's schema;
and how many streams ended as asked (one call, then ``finish_reason: "tool_calls"``).
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import httpx
import jsonschema
from serve import (
    BUILD_LLAMA_SERVER,
    SLOTS,
    ServerError,
    free_port,
    log_tail,
    model_id,
    pair_command,
    percentile,
    started,
    wait_ready,
)

LLAMA_N_CTX = 2048  # per slot
READY_TIMEOUT_S = 300
MAX_TOKENS = 64
PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": PARAMETERS,
    },
}
CITIES = (
    "Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Dakar", "Hanoi", "Perth",
    "Bern", "Delhi", "Seoul", "Accra", "Baku", "Doha", "Riga", "Kyiv", "Lagos", "Sofia",
)  # fmt: skip
QWEN_TEMPLATE = "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"  # in llama.cpp's tree


def default_template(llama_server: Path | None) -> Path | None:
    """Qwen 2.5's template as llama.cpp's source tree ships it, beside the built server
    (``llama.cpp/build/bin/llama-server``)."""
    if llama_server is None:
        return None
    found = llama_server.resolve().parents[2] / QWEN_TEMPLATE
    return found if found.is_file() else None


def with_template(gguf: Path, template: Path, out: Path) -> Path:
    """A copy of ``gguf`` with ``template`` as its chat template."""
    script = ["-m", "gguf.scripts.gguf_new_metadata", str(gguf), str(out), "--force"]
    subprocess.run(
        [sys.executable, *script, "--chat-template-file", str(template)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out


def command(engine: str, gguf: Path, port: int, threads: int, llama_server: Path | None):
    return pair_command(engine, gguf, port, threads, llama_server, LLAMA_N_CTX, ("--jinja",))


def examples() -> list[dict]:
    """Two earlier turns in which the tool was called and answered: a base model writes a
    call only once it has seen one (without them, llama-server, which lets text come
    before the calls even under ``required``, never reaches a call in 256 tokens)."""
    turns: list[dict] = []
    for i, (city, unit) in enumerate([("Berlin", "celsius"), ("Boston", "fahrenheit")]):
        arguments = json.dumps({"city": city, "unit": unit})
        call = {"id": f"call_{i}", "type": "function"}
        call["function"] = {"name": "get_weather", "arguments": arguments}
        turns += [
            {"role": "user", "content": f"What is the weather like in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "sunny, 21 degrees"},
            {"role": "assistant", "content": f"It is sunny in {city}, 21 degrees."},
        ]
    return turns


def body(model: str, i: int) -> dict:
    city = CITIES[i % len(CITIES)]
    ask = {"role": "user", "content": f"Request {i}: what is the weather like in {city}?"}
    return {
        "model": model,
        "messages": [*examples(), ask],
        "tools": [TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }


async def one_call(client: httpx.AsyncClient, url: str, request: dict) -> dict:
    """One streamed request: seconds to the first call's name and to its arguments made
    whole (they parse), whether they are valid, and how the stream ended."""
    start = time.perf_counter()
    named = whole = None
    names, arguments, reason = {}, {}, None
    async with client.stream("POST", url, json=request) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                for call in choice.get("delta", {}).get("tool_calls") or []:
                    index, function = call.get("index", 0), call.get("function", {})
                    named = named or time.perf_counter() - start
                    names[index] = function.get("name") or names.get(index)
                    arguments[index] = arguments.get(index, "") + (function.get("arguments") or "")
                    if whole is None and parses(arguments.get(0, "")):
                        whole = time.perf_counter() - start
                reason = choice.get("finish_reason") or reason
    first = valid(names.get(0), arguments.get(0, ""))
    return {"named": named, "whole": whole, "valid": first, "reason": reason, "calls": len(names)}


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def valid(name: str | None, arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), PARAMETERS)
    except (ValueError, jsonschema.ValidationError):
        return False
    return name == "get_weather"


async def drive(base: str, requests: int, clients: list[int], process) -> dict:
    async with httpx.AsyncClient(timeout=10) as client:  # its idle connections may be closed
        await wait_ready(client, base, READY_TIMEOUT_S, process)
    # A new connection per request: llama-server closes idle kept-alive connections, and
    # a request sent on one as it closes is lost ("Server disconnected").
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=fresh) as client:
        model = await model_id(client, base)
        url = f"{base}/v1/chat/completions"
        await one_call(client, url, body(model, -1))  # warm-up, untimed
        levels = {}
        for count in clients:
            first = count * requests  # no request's text repeats another's, across levels
            numbers = range(first, first + requests)
            levels[count] = await gathered(client, url, model, numbers, count)
        return levels


async def gathered(
    client: httpx.AsyncClient, url: str, model: str, numbers: range, clients: int
) -> list[dict]:
    """The numbered requests, ``clients`` at a time."""
    gate = asyncio.Semaphore(clients)

    async def gated(i: int) -> dict:
        async with gate:
            return await one_call(client, url, body(model, i))

    return list(await asyncio.gather(*(gated(i) for i in numbers)))


def bench(engine: str, args: argparse.Namespace, gguf: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        try:
            port = free_port()
            argv, extra = command(engine, gguf, port, args.threads, args.llama_server)
            with started(argv, {**os.environ, **extra}, log) as process:
                base = f"http://127.0.0.1:{port}"
                return asyncio.run(drive(base, args.requests, args.clients, process))
        except (ServerError, httpx.HTTPError, OSError) as exc:
            return {"error": f"{exc} ({log_tail(log, 1)[:160]})"}


def seconds(values: list[float | None], q: float) -> str:
    found = percentile([v for v in values if v is not None], q)
    return "-" if found is None else f"{found:.3f} s"


def report(results: dict[str, dict], args: argparse.Namespace) -> str:
    head = "| engine | clients | to the name p50 | p99 | to the whole call p50 | p99 |"
    lines = [head + " valid first calls | ended as asked |", "|---" * 8 + "|"]
    for name, levels in results.items():
        if "error" in levels:
            lines.append(f"| {name} | not run: {levels['error']} |")
            continue
        for count, outcomes in levels.items():
            named = [o["named"] for o in outcomes]
            whole = [o["whole"] for o in outcomes]
            good = sum(o["valid"] for o in outcomes)
            ended = sum(o["reason"] == "tool_calls" and o["calls"] == 1 for o in outcomes)
            cells = [seconds(named, 50), seconds(named, 99), seconds(whole, 50)]
            cells += [seconds(whole, 99), f"{good}/{len(outcomes)}", f"{ended}/{len(outcomes)}"]
            lines.append(f"| {name} | {count} | " + " | ".join(cells) + " |")
    note = (
        f"{args.requests} streamed requests per level, tool_choice required, "
        f"parallel_tool_calls false, max_tokens {MAX_TOKENS}, {args.threads} threads; "
        f"llama-server --jinja -np {SLOTS}; the template: {args.template.name}. To the whole "
        "call: until the first call's arguments parse. Valid: they validate against the "
        "tool's schema. Ended as asked: one call, then finish_reason tool_calls."
    )
    return "\n".join(lines) + "\n\n" + note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, help=BUILD_LLAMA_SERVER)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4])
    parser.add_argument(
        "--template",
        type=Path,
        help="a Hermes-style chat template (default: "
        f"{QWEN_TEMPLATE} in llama.cpp's tree beside --llama-server)",
    )
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    args.template = args.template or default_template(args.llama_server)
    if args.template is None:
        parser.error("--template is needed (or --llama-server inside llama.cpp's tree)")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = args.gguf or harness.default_gguf()
        gguf = with_template(gguf, args.template, Path(tmp) / "tools.gguf")
        results = {
            "spnl-backend": bench("ours", args, gguf),
            "llama-server": bench("llama-server", args, gguf),
        }
    harness.publish(report(results, args), args.markdown)


if __name__ == "__main__":
    main()
