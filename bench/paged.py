"""The paged engine on the default model: prefix caching, batching, KV memory.

    python bench/paged.py [--threads 2] [--markdown FILE] [--skip-sequential]

1. prefix cache: 8 requests sharing a ~1,000-token prefix, each with its own ~20-token
   suffix, one after another: TTFT of requests 2-8 against request 1, with prefix caching
   on and off, in paged (block-level) and non-paged (sequence-level) mode;
2. batching: 16 concurrent requests x 128 tokens, total tok/s, against the same 16 one
   after another and against transformers' batched generate (left padding), in paged
   and non-paged mode;
3. KV memory per token for the auto and f8e4m3 cache types, the largest context a 1 GiB
   budget holds, and what FP8 does to the logits and to greedy output.
"""

import argparse
import json
import statistics
import sys
import time

import harness

SUFFIXES = [
    "Question: who wrote the ledger first? Answer:",
    "Question: what did Ada measure at noon? Answer:",
    "Question: how many ledgers were there? Answer:",
    "Question: what was cracked in the lens? Answer:",
    "Question: who carried the ledgers to the boat? Answer:",
    "Question: where are the ledgers kept now? Answer:",
    "Question: what colour were the ledger covers? Answer:",
    "Question: who praised Ada in a report? Answer:",
]
BATCH_PROMPTS = [
    f"Story {i}: Once upon a time, in a village by the sea, there lived" for i in range(16)
]
BATCH_TOKENS = 128


def _backend(**settings):
    return harness.load_ours(harness.default_gguf(), **settings)


def prefix_cache(paged: bool, enabled: bool) -> dict:
    backend = _backend(paged_attn=paged, prefix_cache_n=16 if enabled else 0)
    prefix = harness.long_prompt(backend.tokenizer.encode, tokens=1000)
    backend.generate("Warm-up.", max_tokens=2, temperature=0)
    results = [
        backend.generate(f"{prefix}\n\n{suffix}", max_tokens=1, temperature=0)
        for suffix in SUFFIXES
    ]
    first, rest = results[0].usage.ttft_s, [r.usage.ttft_s for r in results[1:]]
    return {
        "paged": paged,
        "prefix_cache": enabled,
        "prompt_tokens": results[0].usage.prompt_tokens,
        "ttft_first_ms": 1000 * first,
        "ttft_rest_ms": 1000 * statistics.median(rest),
        "ratio": statistics.median(rest) / first,
        "cached_tokens": statistics.median(r.usage.cached_tokens for r in results[1:]),
    }


def batching(paged: bool, sequential: bool) -> dict:
    backend = _backend(paged_attn=paged)
    backend.generate("Warm-up.", max_tokens=2, temperature=0)
    start = time.perf_counter()
    together = backend.generate(BATCH_PROMPTS, max_tokens=BATCH_TOKENS, temperature=0)
    batched_s = time.perf_counter() - start
    tokens = sum(r.usage.completion_tokens for r in together)
    result = {"paged": paged, "batched_tok_s": tokens / batched_s, "tokens": tokens}
    if sequential:
        start = time.perf_counter()
        alone = [backend.generate(p, max_tokens=BATCH_TOKENS, temperature=0) for p in BATCH_PROMPTS]
        sequential_s = time.perf_counter() - start
        result["sequential_tok_s"] = sum(r.usage.completion_tokens for r in alone) / sequential_s
        result["same_tokens"] = sum(
            a.token_ids == b.token_ids for a, b in zip(alone, together, strict=True)
        )
    return result


def transformers_batching() -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = harness.default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    inputs = tokenizer(BATCH_PROMPTS, return_tensors="pt", padding=True)
    model.generate(**inputs, max_new_tokens=2, do_sample=False)
    start = time.perf_counter()
    model.generate(
        **inputs, max_new_tokens=BATCH_TOKENS, min_new_tokens=BATCH_TOKENS, do_sample=False
    )
    return {"batched_tok_s": len(BATCH_PROMPTS) * BATCH_TOKENS / (time.perf_counter() - start)}


def kv_memory() -> dict:
    import torch

    from spnl_backend.memory import kv_bytes_per_token

    backend = _backend(paged_attn=True)
    config = backend.model_config
    rows = {}
    for name, dtype in (
        ("auto (float32)", torch.float32),
        ("auto as bfloat16", torch.bfloat16),
        ("f8e4m3", torch.float8_e4m3fn),
    ):
        per_token = kv_bytes_per_token(config, dtype)
        rows[name] = {"bytes_per_token": per_token, "tokens_in_1GiB": (1 << 30) // per_token}
    sized = _backend(paged_attn=True, paged_cache_type="f8e4m3", paged_attn_memory_mb=1024)
    rows["f8e4m3"]["allocated_tokens_1GiB"] = sized.cache_info().capacity_tokens
    rows["fp8_quality"] = _fp8_quality(backend)
    return rows


def _fp8_quality(auto_backend) -> dict:
    fp8_backend = _backend(paged_attn=True, paged_cache_type="f8e4m3", prefix_cache_n=0)
    ids = harness.text_ids(auto_backend.tokenizer.encode, 512)
    auto = harness.our_logits(_backend(paged_attn=True, prefix_cache_n=0), ids)
    fp8 = harness.our_logits(fp8_backend, ids)
    agree_top1 = float((auto.argmax(-1) == fp8.argmax(-1)).float().mean())
    greedy_auto = auto_backend.generate(BATCH_PROMPTS[0], max_tokens=64, temperature=0).token_ids
    greedy_fp8 = fp8_backend.generate(BATCH_PROMPTS[0], max_tokens=64, temperature=0).token_ids
    same = next(
        (i for i, (a, b) in enumerate(zip(greedy_auto, greedy_fp8, strict=True)) if a != b), 64
    )
    return {
        "logits_relative_l2": float((fp8 - auto).norm() / auto.norm()),
        "top1_agreement": agree_top1,
        "greedy_tokens_identical": same,
    }


def _child(task: str, args: list[str]) -> dict | list:
    """Every table needs every task: a failed one stops the run, with its stderr."""
    try:
        return harness.child_json([sys.executable, __file__, "--child", task, *args])
    except harness.ChildError as failure:
        raise RuntimeError(f"{task} failed: {failure}") from None


CHILD_TASKS = {
    "prefix": lambda a: [
        prefix_cache(paged, on) for paged in (True, False) for on in (True, False)
    ],
    "batching": lambda a: [batching(paged, not a.skip_sequential) for paged in (True, False)],
    "transformers": lambda a: transformers_batching(),
    "memory": lambda a: kv_memory(),
}


def mode(paged: bool) -> str:
    return "paged" if paged else "non-paged"


def prefix_table(prefix: list[dict]) -> str:
    header = ["mode", "prefix caching", "prompt tokens", "TTFT request 1", "TTFT requests 2-8"]
    header += ["ratio", "cached tokens"]
    rows = [
        [
            mode(r["paged"]),
            "on" if r["prefix_cache"] else "off",
            r["prompt_tokens"],
            f"{r['ttft_first_ms']:.0f} ms",
            f"{r['ttft_rest_ms']:.0f} ms",
            f"{r['ratio']:.2f}x",
            f"{r['cached_tokens']:.0f}",
        ]
        for r in prefix
    ]
    return harness.md_table(header, rows)


def batch_row(r: dict) -> list[str]:
    row = [f"spnl-backend, {mode(r['paged'])}", f"{r['batched_tok_s']:.1f}"]
    sequential = r.get("sequential_tok_s")
    if sequential:
        row += [f"{sequential:.1f}", f"{r['batched_tok_s'] / sequential:.1f}x"]
        row.append(f"{r['same_tokens']}/16")
    return row


def batch_table(batch: list[dict], hf: dict) -> str:
    header = ["engine", "total tok/s", "one after another", "speed-up", "same tokens"]
    rows = [batch_row(r) for r in batch]
    rows.append(["transformers float32, batched `generate`", f"{hf['batched_tok_s']:.1f}"])
    return harness.md_table(header, rows)


def memory_table(memory: dict) -> str:
    rows = [
        [name, f"{memory[name]['bytes_per_token']:,}", f"{memory[name]['tokens_in_1GiB']:,}"]
        for name in ("auto (float32)", "auto as bfloat16", "f8e4m3")
    ]
    return harness.md_table(["cache type", "bytes per token", "tokens in a 1 GiB budget"], rows)


def report(prefix: list[dict], batch: list[dict], hf: dict, memory: dict) -> str:
    quality = memory["fp8_quality"]
    return "\n".join(
        [
            "**Prefix cache** (8 requests, shared ~1,000-token prefix, own suffix; "
            "TTFT median of requests 2-8 against request 1):",
            "",
            prefix_table(prefix),
            "",
            f"**Batching** (16 concurrent requests x {BATCH_TOKENS} tokens, greedy):",
            "",
            batch_table(batch, hf),
            "",
            "**KV cache memory** (default model: 18 layers x 1 KV head x 256 dims):",
            "",
            memory_table(memory),
            "",
            f"`MISTRALRS_PAGED_ATTN_MEMORY_MB=1024` with f8e4m3 allocates "
            f"{memory['f8e4m3']['allocated_tokens_1GiB']:,} tokens. FP8 against the auto "
            f"cache over a 512-token prompt: logits relative L2 error "
            f"{quality['logits_relative_l2']:.3f}, top-1 agreement "
            f"{100 * quality['top1_agreement']:.1f}%, greedy output identical for the first "
            f"{quality['greedy_tokens_identical']} of 64 tokens.",
        ]
    )


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument(
        "--skip-sequential", action="store_true", help="skip the slow one-after-another baseline"
    )
    parser.add_argument("--child", choices=list(CHILD_TASKS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(CHILD_TASKS[args.child](args)))
        return
    passed = ["--threads", str(args.threads)] + (
        ["--skip-sequential"] if args.skip_sequential else []
    )
    results = {task: _child(task, passed) for task in CHILD_TASKS}
    print(json.dumps(results), file=sys.stderr)
    text = report(
        results["prefix"], results["batching"], results["transformers"], results["memory"]
    )
    harness.publish(text, args.markdown)


if __name__ == "__main__":
    main()
