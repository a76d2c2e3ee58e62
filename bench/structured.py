"""Structured output on the default model: what constraining a JSON schema costs per token,
and to compile, side by side with llama.cpp's grammars, in one run.

    python bench/structured.py [--peers-python PATH] [--threads 2] [--runs 3] [--markdown FILE]

Each engine runs in a fresh process on the default GGUF (Gemma 3 270M Q4_K_M) with the
same threads and the same chat request (a person described by `SCHEMA`), sampled at
temperature 1 with fixed seeds:

- decode tok/s of `TOKENS`-token chat completions, free and under the schema, at batch 1
  and, for spnl-backend, at batch 16 (16 concurrent completions; llama-cpp-python runs one
  sequence at a time). A free completion ignores EOS and the schema asks for more than
  `TOKENS`, so every completion makes exactly `TOKENS` tokens and a batch never thins out.
- compile: the first schema in a fresh process (for spnl-backend this builds llguidance's
  view of the 262k-token vocabulary and its JSON lexer), then the median over
  `SCHEMAS_TO_COMPILE` more schemas: ours through `Backend.prepare` (compiled and its
  first mask computed), llama.cpp's `LlamaGrammar.from_json_schema` (what its
  `response_format` compiles the schema with).
- of 16 constrained completions with room to end (`VALID_TOKENS`): how many ended, and how
  many parse as JSON and validate (checked by this process: a peer's venv lacks
  jsonschema).

llama.cpp runs with the interpreter given by --peers-python (it usually lives in its own
venv; see ../shared/PEERS.md for building it on an AMX machine).
"""

import json
import statistics
import sys
import time
from pathlib import Path

import harness

TOKENS = 32
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
        "bio": {"type": "string", "minLength": 100, "maxLength": 400},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "bio", "hobbies"],
}
VALID_TOKENS = 400
MESSAGES = [
    {
        "role": "user",
        "content": "Describe a fictional person as a JSON object with their name, age, city "
        "and hobbies.",
    }
]
SCHEMAS_TO_COMPILE = 5


def other_schema(i: int) -> dict:
    """A schema of the same shape with other property names (nothing cached between)."""
    return {
        "type": "object",
        "properties": {f"{key}_{i}": value for key, value in SCHEMA["properties"].items()},
        "required": [f"{key}_{i}" for key in SCHEMA["required"]],
    }


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# ---- engines ------------------------------------------------------------------------------


def run_ours(gguf: Path, threads: int, runs: int) -> dict:
    import torch

    from spnl_backend.request import sampling_params

    torch.set_num_threads(threads)
    backend = harness.load_ours(gguf, prefix_cache_n=0)
    backend.chat(MESSAGES, max_tokens=4, temperature=0)  # warm-up
    start = time.perf_counter()
    backend.prepare(sampling_params(json_schema=SCHEMA))
    first_compile = time.perf_counter() - start
    compiles = [
        harness.seconds(lambda i=i: backend.prepare(sampling_params(json_schema=other_schema(i))))
        for i in range(SCHEMAS_TO_COMPILE)
    ]
    out = {"first_compile_s": first_compile, "compile_ms": 1000 * statistics.median(compiles)}
    for batch in (1, 16):
        out[f"free_{batch}"] = _rate(backend, batch, runs, {"ignore_eos": True})
        out[f"schema_{batch}"] = _rate(backend, batch, runs, {"json_schema": SCHEMA})
    ended = _together(backend, 16, 1000, VALID_TOKENS, {"json_schema": SCHEMA})
    out["texts"] = [r.text if r.finish_reason == "stop" else "" for r in ended]
    return out


def _rate(backend, batch: int, runs: int, options: dict) -> float:
    """Median over runs of the completions' mean decode tok/s (each makes `TOKENS`)."""
    rates = []
    for run in range(runs):
        results = _together(backend, batch, run * batch, TOKENS, options)
        assert all(r.usage.completion_tokens == TOKENS for r in results), "one ended early"
        rates.append(statistics.mean(r.usage.decode_tok_s for r in results))
    return statistics.median(rates)


def _together(backend, batch: int, seed: int, tokens: int, options: dict) -> list:
    """``batch`` chat completions submitted together (one engine batch)."""
    import asyncio

    async def run() -> list:
        calls = [
            backend.achat(MESSAGES, max_tokens=tokens, temperature=1.0, seed=seed + i, **options)
            for i in range(batch)
        ]
        return await asyncio.gather(*calls)

    return asyncio.run(run())


def run_llama_cpp(gguf: Path, threads: int, runs: int) -> dict:
    from llama_cpp import LlamaGrammar

    llm = harness.load_llama_cpp(gguf, threads)
    start = time.perf_counter()
    LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)
    first_compile = time.perf_counter() - start
    compiles = [
        harness.seconds(
            lambda i=i: LlamaGrammar.from_json_schema(json.dumps(other_schema(i)), verbose=False)
        )
        for i in range(SCHEMAS_TO_COMPILE)
    ]
    schema = {"response_format": {"type": "json_object", "schema": SCHEMA}}
    rates = {}
    for name, options in (("free_1", {}), ("schema_1", schema)):
        rates[name] = statistics.median(
            _llama_stream(llm, seed, TOKENS, options)[0] for seed in range(runs)
        )
    ended = [_llama_stream(llm, 1000 + i, VALID_TOKENS, schema) for i in range(16)]
    return {
        "first_compile_s": first_compile,
        "compile_ms": 1000 * statistics.median(compiles),
        **rates,
        "texts": [text if finish == "stop" else "" for _, text, finish in ended],
    }


def _llama_stream(llm, seed: int, tokens: int, options: dict) -> tuple[float, str, str]:
    """One streamed chat completion from a fresh cache: tokens after the first per second
    (a chunk per token), its text and finish reason."""
    llm.reset()
    stamps, pieces, finish = [], [], ""
    stream = llm.create_chat_completion(
        MESSAGES, max_tokens=tokens, temperature=1.0, seed=seed, stream=True, **options
    )
    for chunk in stream:
        choice = chunk["choices"][0]
        if choice["delta"].get("content"):
            stamps.append(time.perf_counter())
            pieces.append(choice["delta"]["content"])
        finish = choice.get("finish_reason") or finish
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return rate, "".join(pieces), finish


ENGINES = {"spnl-backend": run_ours, "llama.cpp": run_llama_cpp}


# ---- the table ----------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{1000 * seconds:.1f} ms"


def _overhead(free: float, schema: float) -> str:
    return f"{100 * (schema / free - 1):+.1f}%"


def table(results: list[dict], threads: int) -> str:
    header = [
        "engine",
        "batch",
        "free tok/s",
        "JSON schema tok/s",
        "change",
        "first schema compile",
        "later schema compile",
        "of 16 long ones: ended, valid",
    ]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["engine"], f"not run: {r['error']}"])
            continue
        for batch in (1, 16):
            if f"free_{batch}" not in r:
                rows.append([r["engine"], str(batch), "single-sequence API"])
                continue
            free, schema = r[f"free_{batch}"], r[f"schema_{batch}"]
            rows.append(
                [
                    r["engine"],
                    str(batch),
                    f"{free:.1f}",
                    f"{schema:.1f}",
                    _overhead(free, schema),
                    _duration(r["first_compile_s"]),
                    f"{r['compile_ms']:.1f} ms",
                    f"{r['ended']}, {r['valid']}",
                ]
            )
    return (
        f"{harness.md_table(header, rows)}\n\n"
        f"{threads} threads; chat completions of {TOKENS} tokens at temperature 1, tok/s per "
        "completion (median of runs). Of 16 constrained completions with room for "
        f"{VALID_TOKENS} tokens: those that ended (EOS; the others ran out of tokens), and "
        "those that parse and validate. llama.cpp's compile is its conversion of the schema "
        "to a GBNF grammar; it parses that grammar as the request starts, within its timing."
    )


def main() -> None:
    parser = harness.arguments(__doc__, runs=True)
    harness.add_peers_python(parser, "llama-cpp-python")
    parser.add_argument("--child", choices=list(ENGINES), help="run one engine, print JSON")
    parser.add_argument("--gguf", type=Path, help="the model (default: the embedded one)")
    args = parser.parse_args()
    gguf = args.gguf or harness.default_gguf()
    if args.child:
        print(json.dumps(ENGINES[args.child](gguf, args.threads, args.runs)))
        return
    results = []
    for engine in ENGINES:
        python = args.peers_python if engine == "llama.cpp" else sys.executable
        command = [python, __file__, "--child", engine, "--gguf", gguf]
        command += ["--threads", args.threads]
        command += ["--runs", args.runs]
        result = {"engine": engine} | harness.run_json_child(command)
        texts = result.pop("texts", [])  # validated here: a peer's venv lacks jsonschema
        result["ended"] = sum(map(bool, texts))  # "" stands for one that ran out of tokens
        result["valid"] = sum(map(valid, texts))
        results.append(result)
        print(json.dumps(results[-1]), file=sys.stderr)
    harness.publish(table(results, args.threads), args.markdown)


if __name__ == "__main__":
    main()
