"""Single-sequence speed on the default model, side by side with the peers, in one run.

    python bench/decode.py [--peers-python PATH] [--threads 2] [--runs 3] [--markdown FILE]

For each engine a fresh process loads the default GGUF (Gemma 3 270M Q4_K_M) and
measures, with the same thread count and greedy decoding:

- TTFT: a 6-token prompt to its first token;
- prefill tok/s: a ~1,024-token prompt (the shipped English text) to its first token;
- decode tok/s: 128 tokens after the first, from the short prompt;
- peak RSS of the process.

Engines: ours (spnl-backend; and "spnl-backend, small pages", the same with its weights and
KV pool on the allocator's 4 KB pages instead of huge pages), llama.cpp (llama-cpp-python)
and mistral.rs (mistralrs), both run with the interpreter given by --peers-python since they
usually live in their own venv, and transformers (float32, the GGUF dequantized). An engine
that is not installed is reported as such. The children inherit the environment, so
``PYTHONPATH=CHECKOUT python bench/decode.py`` measures the spnl_backend of another checkout
(a before/after pair).

The table also gives the bound that memory bandwidth sets on decode: the weight bytes one
token reads (every tensor once; the tied embedding once, as the output layer) over the read
bandwidth measured here with the same threads (bench/read_bound.py: a native streaming read
of at least 1 GiB, a torch sum where no C compiler is found), and each engine's decode as a
share of it.
"""

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import harness
import read_bound
from harness import DECODE_TOKENS, STORY_PROMPT

SHORT_PROMPT = "The capital of France is"
PREFILL_TOKENS = 1024


# ---- engines: each loads the model and returns its three probes ----------------------------
# ttft() -> seconds; prefill() -> (tok/s, prompt tokens); decode() -> (tok/s, tokens made)

Probes = tuple[
    Callable[[], float], Callable[[], tuple[float, int]], Callable[[], tuple[float, int]]
]


def run_ours(gguf: Path, threads: int, small_pages: bool = False) -> Probes:
    """``small_pages``: the weights and the KV pool on the allocator's small pages, not on
    the huge pages the library asks for (what that choice is worth)."""
    import torch

    if small_pages:
        import spnl_backend.memory

        spnl_backend.memory.HUGE_PAGE_MIN_BYTES = 1 << 62
    torch.set_num_threads(threads)
    # Prefix caching off: the repeated runs must not reuse each other's prompts.
    # The native kernels' pool at the same count: it follows the CPUs, not torch's setting.
    backend = harness.load_ours(gguf, prefix_cache_n=0, num_threads=threads)
    prompt = harness.long_prompt(backend.tokenizer.encode, PREFILL_TOKENS)
    backend.generate(SHORT_PROMPT, max_tokens=4, temperature=0)  # warm-up

    def ttft() -> float:
        return backend.generate(SHORT_PROMPT, max_tokens=1, temperature=0).usage.ttft_s

    def prefill() -> tuple[float, int]:
        result = backend.generate(prompt, max_tokens=1, temperature=0)
        return result.usage.prompt_tokens / result.usage.ttft_s, result.usage.prompt_tokens

    def decode() -> tuple[float, int]:
        result = backend.generate(STORY_PROMPT, max_tokens=DECODE_TOKENS + 1, temperature=0)
        return result.usage.decode_tok_s, result.usage.completion_tokens

    return ttft, prefill, decode


def llama_cpp_stream_times(llm, text: str, max_tokens: int) -> tuple[float, float, int]:
    """A greedy completion streamed by llama-cpp-python's ``llm``, from a fresh cache:
    seconds to the first token, seconds from it to the last, and the tokens streamed."""
    llm.reset()
    start = time.perf_counter()
    first = last = None
    count = 0
    for _ in llm.create_completion(text, max_tokens=max_tokens, temperature=0.0, stream=True):
        last = time.perf_counter()
        first = first or last
        count += 1
    return first - start, last - first, count


StreamTimer = Callable[[object, str, int], tuple[float, float, int]]


def run_llama_cpp(gguf: Path, threads: int, timer: StreamTimer = llama_cpp_stream_times) -> Probes:
    """``timer``: how a completion is timed (bench/real_sizes.py times tokens instead)."""
    llm = harness.load_llama_cpp(gguf, threads)
    prompt = harness.long_prompt(lambda text: llm.tokenize(text.encode()), PREFILL_TOKENS)

    first_token_time = functools.partial(timer, llm)

    first_token_time(SHORT_PROMPT, 4)  # warm-up

    def ttft() -> float:
        return first_token_time(SHORT_PROMPT, 1)[0]

    def prefill() -> tuple[float, int]:
        tokens = len(llm.tokenize(prompt.encode()))
        return tokens / first_token_time(prompt, 1)[0], tokens

    def decode() -> tuple[float, int]:
        _, span, count = first_token_time(STORY_PROMPT, DECODE_TOKENS + 1)
        return (count - 1) / span, count

    return ttft, prefill, decode


def run_mistralrs(gguf: Path, threads: int) -> Probes:
    """mistral.rs converts the GGUF's vocabulary itself (it reads this file's as Unigram, so
    its tokens are near single characters and its text is not meaningful); the prompts are
    cut to the same token counts in its own tokenization, so the work per token compares."""
    import os

    os.environ["RAYON_NUM_THREADS"] = str(threads)
    from mistralrs import CompletionRequest, Runner, Which

    runner = Runner(
        which=Which.GGUF(quantized_model_id=str(gguf.parent), quantized_filename=gguf.name),
        token_source="none",
        prefix_cache_n=0,
    )

    def encode(text: str) -> list[int]:
        return runner.tokenize_text(text, True, False)

    prompt = harness.long_prompt(encode, PREFILL_TOKENS)

    def complete(text: str, max_tokens: int) -> tuple[float, int]:
        request = CompletionRequest(
            prompt=text, model="default", max_tokens=max_tokens, temperature=0.0
        )
        start = time.perf_counter()
        usage = runner.send_completion_request(request).usage
        return time.perf_counter() - start, usage.completion_tokens

    complete(SHORT_PROMPT, 4)  # warm-up

    def ttft() -> float:
        return complete(SHORT_PROMPT, 1)[0]

    def prefill() -> tuple[float, int]:
        tokens = len(encode(prompt))
        return tokens / complete(prompt, 1)[0], tokens

    def decode() -> tuple[float, int]:
        first, _ = complete(STORY_PROMPT, 1)
        total, count = complete(STORY_PROMPT, DECODE_TOKENS + 1)
        return (count - 1) / (total - first), count

    return ttft, prefill, decode


def run_transformers(gguf: Path, threads: int) -> Probes:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    prompt = harness.long_prompt(lambda text: tokenizer(text).input_ids, PREFILL_TOKENS)

    def timed(text: str, new_tokens: int) -> tuple[float, int]:
        ids = tokenizer(text, return_tensors="pt").input_ids
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - start, ids.shape[1]

    timed(SHORT_PROMPT, 4)  # warm-up

    def ttft() -> float:
        return timed(SHORT_PROMPT, 1)[0]

    def prefill() -> tuple[float, int]:
        seconds, tokens = timed(prompt, 1)
        return tokens / seconds, tokens

    def decode() -> tuple[float, int]:
        first, _ = timed(STORY_PROMPT, 1)
        total, _ = timed(STORY_PROMPT, DECODE_TOKENS + 1)
        return DECODE_TOKENS / (total - first), DECODE_TOKENS + 1

    return ttft, prefill, decode


PEERS_IN_OWN_VENV = ("llama.cpp", "mistral.rs")
ENGINES = {
    "spnl-backend": run_ours,
    "spnl-backend, small pages": functools.partial(run_ours, small_pages=True),
    "llama.cpp": run_llama_cpp,
    "mistral.rs": run_mistralrs,
    "transformers fp32": run_transformers,
}


def weight_bytes_per_token(gguf: Path) -> int:
    """Bytes of weights one decode step reads: every tensor once (a tied embedding is read
    whole as the output layer; its lookup adds one row, which is negligible)."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(gguf).tensors)


def measure(
    engine: str, gguf: Path, threads: int, runs: int, run: Callable[..., Probes] | None = None
) -> dict:
    """``run``: the engine's probes, ``ENGINES[engine]`` by default."""
    start = time.perf_counter()
    ttft, prefill, decode = (run or ENGINES[engine])(gguf, threads)
    load_s = time.perf_counter() - start
    ttfts = [ttft() for _ in range(runs)]
    prefills = [prefill() for _ in range(runs)]
    decodes = [decode() for _ in range(runs)]
    return {
        "engine": engine,
        "load_s": load_s,
        "ttft_ms": 1000 * statistics.median(ttfts),
        "prefill_tok_s": statistics.median(p[0] for p in prefills),
        "prefill_tokens": prefills[0][1],
        "decode_tok_s": statistics.median(d[0] for d in decodes),
        "decode_tokens": decodes[0][1],
        "peak_rss_mb": harness.peak_rss_mb(),
    }


def run_child(engine: str, python: str, gguf: Path, threads: int, runs: int) -> dict:
    command = [python, __file__, "--child", engine, "--gguf", gguf]
    command += ["--threads", threads, "--runs", runs]
    return {"engine": engine} | harness.run_json_child(command)


HEADER = [
    "engine",
    "decode tok/s",
    "of the bandwidth bound",
    "TTFT (6-token prompt)",
    "prefill tok/s",
    "peak RSS",
    "load",
]


def bandwidth_bound(bandwidth: dict, per_token: int) -> dict:
    """The decode bound from ``read_bound.read_bandwidth``'s figure and the bytes one
    token reads."""
    gb_s = bandwidth["gb_s"]
    return bandwidth | {"mb_per_token": per_token / 1e6, "tok_s": gb_s * 1e9 / per_token}


def table_row(r: dict, bound: dict) -> list[str]:
    if "error" in r:
        return [r["engine"], f"not run: {r['error']}"]
    return [
        r["engine"],
        f"{r['decode_tok_s']:.1f}",
        f"{100 * r['decode_tok_s'] / bound['tok_s']:.0f}%",
        f"{r['ttft_ms']:.0f} ms",
        f"{r['prefill_tok_s']:.0f} ({r['prefill_tokens']} tokens)",
        f"{r['peak_rss_mb']:,.0f} MB",
        f"{r['load_s']:.1f} s",
    ]


def table(results: list[dict], threads: int, bound: dict) -> str:
    rows = [table_row(r, bound) for r in results]
    rows.append(["bandwidth bound", f"{bound['tok_s']:.0f}", "100%"])
    return (
        f"{harness.md_table(HEADER, rows)}\n\n"
        f"{threads} threads, greedy, {DECODE_TOKENS} decode tokens, median of runs. "
        f"Bound: {bound['mb_per_token']:.0f} MB of weights per token over "
        f"{bound['gb_s']:.1f} GB/s measured read bandwidth ({bound['method']})."
    )


def engine_name(text: str) -> str:
    """An engine named in full or by a prefix of one name only (``spnl``, ``llama``)."""
    matches = [name for name in ENGINES if name == text] or [
        name for name in ENGINES if name.startswith(text)
    ]
    if len(matches) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(ENGINES)}")
    return matches[0]


def main() -> None:
    parser = harness.arguments(__doc__, runs=True)
    harness.add_peers_python(parser, "llama-cpp-python and mistralrs", "--llama-python")
    parser.add_argument(
        "--engines", nargs="+", type=engine_name, default=list(ENGINES), help=", ".join(ENGINES)
    )
    parser.add_argument("--child", choices=list(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.gguf, args.threads, args.runs)))
        return
    gguf = harness.default_gguf()
    results = []
    for engine in args.engines:
        python = args.peers_python if engine in PEERS_IN_OWN_VENV else sys.executable
        results.append(run_child(engine, python, gguf, args.threads, args.runs))
        print(json.dumps(results[-1]), file=sys.stderr)
    # After the engines: a child's peak RSS starts from its parent's at fork time.
    bound = bandwidth_bound(read_bound.read_bandwidth(args.threads), weight_bytes_per_token(gguf))
    print(json.dumps({"bandwidth_bound": bound}), file=sys.stderr)
    harness.publish(table(results, args.threads, bound), args.markdown)


if __name__ == "__main__":
    main()
