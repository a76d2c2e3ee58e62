"""KV-cache compression on the default model: memory, perplexity, greedy agreement, speed.

    python bench/kv_compression.py [--peers-python PATH] [--threads 2] [--tokens 4096]
        [--methods none f32 fp8 int8 tq4 tq3 tq4-qjl tq3-qjl] [--modes paged nonpaged]
        [--peer-types f16 q8_0 q4_0] [--markdown FILE]

Each row is one fresh process that loads the default GGUF (Gemma 3 270M Q4_K_M) with one
KV-cache compression method and measures, with the same thread count:

- KV bytes per token: all layers, K and V, and that as a share of a 16-bit cache;
- perplexity over the first --tokens tokens of the shipped English text (all of it when
  it is shorter, which the table then says);
- greedy agreement: the text less its last 128 tokens is the prompt, 128 greedy tokens are
  generated, and each position is compared with the uncompressed run of the same engine
  (and mode): the share of positions that agree and the first that does not (128: none);
- decode tok/s of those 128 tokens, and the prefill time of the prompt (to its first
  token).

Ours (spnl-backend) runs every method of MISTRALRS_KV_CACHE_COMPRESSION with the paged
cache (``paged_attn_context_len`` 8192) and with the contiguous one, prefix caching off
(``none``: uncompressed, float16 on the CPU, the default; ``f32``: uncompressed with
MISTRALRS_PAGED_CACHE_TYPE=f32, K and V kept exactly).
The peer is llama.cpp (llama-cpp-python, run by --peers-python) with flash attention and
its f16, q8_0 and q4_0 cache types; it is fed the same token ids as ours, and its greedy
tokens are also compared with ours uncompressed. The uncompressed runs (ours ``none`` and
llama.cpp ``f16``) always run, first, since the other rows are compared with them.
"""

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import harness
from harness import STORY_PROMPT

METHODS = ["none", "f32", "fp8", "int8", "tq4", "tq3", "tq4-qjl", "tq3-qjl"]
MODES = ["paged", "nonpaged"]
PAGED_CONTEXT_LEN = 8192
# llama.cpp cache types: ggml type id, bytes per element (blocks of 32 for the quantized).
PEER_TYPES = {"f16": (1, 2.0), "q8_0": (8, 34 / 32), "q4_0": (2, 18 / 32)}
GREEDY_TOKENS = 128
OURS, LLAMA = "spnl-backend", "llama.cpp"


# ---- ours -----------------------------------------------------------------------------------


def our_cache_settings(mode: str) -> dict:
    if mode == "paged":
        return {"paged_attn": True, "paged_attn_context_len": PAGED_CONTEXT_LEN}
    return {"paged_attn": False}


def our_method_settings(method: str) -> dict:
    """``f32`` is the uncompressed cache kept in float32; the rest are compression methods."""
    if method == "f32":
        return {"kv_cache_compression": "none", "paged_cache_type": "f32"}
    return {"kv_cache_compression": method}


def our_kv_bytes(backend) -> tuple[int | None, int]:
    """Bytes per token of the backend's cache (None: a method that does not say) and of a
    16-bit cache, for the model's config."""
    import torch

    from spnl_backend.memory import kv_bytes_per_token

    full = kv_bytes_per_token(backend.model_config, torch.float16)
    return backend.cache_info().bytes_per_token, full


def our_greedy(backend, prompt: list[int]) -> dict:
    """128 greedy tokens after ``prompt``, given as text that encodes back to it."""
    text = backend.tokenizer.decode(prompt)
    if backend.tokenizer.encode(text) != prompt:
        raise RuntimeError("the prompt's text does not encode back to its token ids")
    result = backend.generate(text, max_tokens=GREEDY_TOKENS, temperature=0)
    return {
        "tokens": result.token_ids,
        "prefill_s": result.usage.ttft_s,
        "decode_tok_s": result.usage.decode_tok_s,
        "prompt_tokens": result.usage.prompt_tokens,
    }


def cache_kind(info) -> str:
    """The cache's kind and, where the backend knows it, its storage dtype."""
    return f"{info.kind} {info.dtype or ''}".strip()


def measure_ours(method: str, mode: str, gguf: Path, threads: int, tokens: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    cache = our_cache_settings(mode)
    backend = harness.load_ours(gguf, prefix_cache_n=0, **our_method_settings(method), **cache)
    ids = harness.text_ids(backend.tokenizer.encode, tokens)
    backend.generate(STORY_PROMPT, max_tokens=4, temperature=0)  # warm-up
    greedy = our_greedy(backend, ids[:-GREEDY_TOKENS])
    kv_bytes, full = our_kv_bytes(backend)
    return greedy | {
        "kv_bytes": kv_bytes,
        "kv_bytes_16bit": full,
        "perplexity": harness.our_perplexity(backend, ids),
        "text_tokens": len(ids),
        "cache": cache_kind(backend.cache_info()),
        "ids": ids,
    }


# ---- llama.cpp (runs under --peers-python) ---------------------------------------------------


def llama_load(gguf: Path, ggml_type: int, threads: int, n_ctx: int, logits_all: bool):
    from llama_cpp import Llama

    return Llama(
        model_path=str(gguf),
        n_ctx=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        type_k=ggml_type,
        type_v=ggml_type,
        flash_attn=True,  # llama.cpp quantizes the V cache only with flash attention
        logits_all=logits_all,
        seed=0,
        verbose=False,
    )


def llama_kv_bytes(llm, bytes_per_element: float) -> tuple[float, float]:
    """llama.cpp's cache per token, from its own reading of the GGUF (spnl_backend is not
    importable under --peers-python): its type's, and 16-bit's."""
    meta = llm.metadata
    arch = meta["general.architecture"]
    layers = int(meta[f"{arch}.block_count"])
    kv_heads = int(meta[f"{arch}.attention.head_count_kv"])
    key_dim = int(meta[f"{arch}.attention.key_length"])
    value_dim = int(meta[f"{arch}.attention.value_length"])
    elements = layers * kv_heads * (key_dim + value_dim)
    return elements * bytes_per_element, elements * 2.0


def llama_ids(llm, ids_file: Path | None, tokens: int) -> tuple[list[int], bool | None]:
    """llama.cpp's own token ids of the text, or ours where they differ; whether they agree
    (None: ours were not there to compare with)."""
    own = harness.text_ids(lambda text: llm.tokenize(text.encode()), tokens)
    if ids_file is None or not ids_file.exists():
        return own, None
    ours = json.loads(ids_file.read_text())
    return (own, True) if own == ours else (ours, False)


def llama_next_token(llm) -> int:
    import numpy as np

    logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def llama_greedy(llm, prompt: list[int]) -> dict:
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    tokens = [llama_next_token(llm)]
    first = time.perf_counter()
    while len(tokens) < GREEDY_TOKENS and not llama_cpp.llama_vocab_is_eog(vocab, tokens[-1]):
        llm.eval([tokens[-1]])
        tokens.append(llama_next_token(llm))
    last = time.perf_counter()
    return {
        "tokens": tokens,
        "prefill_s": first - start,
        "decode_tok_s": (len(tokens) - 1) / (last - first) if len(tokens) > 1 else 0.0,
        "prompt_tokens": len(prompt),
    }


def llama_perplexity(llm, ids: list[int]) -> float:
    import numpy as np

    llm.reset()
    llm.eval(ids)
    total, rows = 0.0, len(ids) - 1
    for start in range(0, rows, 256):
        stop = min(rows, start + 256)
        logits = np.asarray(llm.scores[start:stop], dtype=np.float64)
        peak = logits.max(axis=1)
        log_norm = peak + np.log(np.exp(logits - peak[:, None]).sum(axis=1))
        targets = np.asarray(ids[start + 1 : stop + 1])
        total += float((log_norm - logits[np.arange(stop - start), targets]).sum())
    return math.exp(total / rows)


def measure_llama(kind: str, gguf: Path, threads: int, tokens: int, ids_file) -> dict:
    ggml_type, bytes_per_element = PEER_TYPES[kind]
    n_ctx = tokens + 512
    llm = llama_load(gguf, ggml_type, threads, n_ctx, logits_all=False)
    ids, same_ids = llama_ids(llm, ids_file, tokens)
    kv_bytes, full = llama_kv_bytes(llm, bytes_per_element)
    llm.eval(llm.tokenize(STORY_PROMPT.encode()))  # warm-up
    greedy = llama_greedy(llm, ids[:-GREEDY_TOKENS])
    llm.close()
    # Scores at every position: a separate context, so the timed prefill above computes
    # only the last position's logits, as ours does.
    llm = llama_load(gguf, ggml_type, threads, n_ctx, logits_all=True)
    perplexity = llama_perplexity(llm, ids)
    return greedy | {
        "kv_bytes": kv_bytes,
        "kv_bytes_16bit": full,
        "perplexity": perplexity,
        "text_tokens": len(ids),
        "same_ids_as_ours": same_ids,
    }


# ---- the parent: children, comparisons, table -----------------------------------------------


def run_ours_child(method: str, mode: str, gguf: Path, args) -> dict:
    command = [sys.executable, __file__, "--child-ours", method, "--mode", mode]
    command += ["--gguf", gguf, "--threads", args.threads, "--tokens", args.tokens]
    return {"method": method, "engine": OURS, "mode": mode} | harness.run_json_child(command)


def run_llama_child(kind: str, gguf: Path, args, ids_file: Path) -> dict:
    command = [args.peers_python, __file__, "--child-llama", kind, "--ids", str(ids_file)]
    command += ["--gguf", gguf, "--threads", args.threads, "--tokens", args.tokens]
    return {"method": kind, "engine": LLAMA, "mode": "flash attn"} | harness.run_json_child(command)


def reference_first(chosen: list[str], reference: str) -> list[str]:
    return [reference] + [name for name in chosen if name != reference]


def agreement(tokens: list[int], reference: list[int]) -> tuple[float, int]:
    """Share of the 128 positions where both runs made the same token (both having
    stopped counts as agreeing), and the first position where they did not (128: none)."""
    pairs = [
        (tokens[i] if i < len(tokens) else None, reference[i] if i < len(reference) else None)
        for i in range(GREEDY_TOKENS)
    ]
    same = [a == b for a, b in pairs]
    return sum(same) / GREEDY_TOKENS, same.index(False) if False in same else GREEDY_TOKENS


def compare(rows: list[dict], ours_mode: str | None) -> None:
    """Add to each row its agreement with and perplexity change from the uncompressed run of
    its engine and mode, and its agreement with ours uncompressed in ``ours_mode``."""
    done = [r for r in rows if "error" not in r]
    reference = {(r["engine"], r["mode"]): r for r in done if r["method"] in ("none", "f16")}
    ours = reference.get((OURS, ours_mode))
    for r in done:
        base = reference.get((r["engine"], r["mode"]))
        if base is not None:
            r["agreement"], r["first_divergence"] = agreement(r["tokens"], base["tokens"])
            r["delta_perplexity"] = r["perplexity"] - base["perplexity"]
        if ours is not None:
            r["agreement_ours_none"], r["first_divergence_ours_none"] = agreement(
                r["tokens"], ours["tokens"]
            )


def number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def table_row(r: dict) -> list[str]:
    head = [r["method"], r["engine"], r["mode"]]
    if "error" in r:
        return [*head, f"not run: {r['error']}"]
    known = r["kv_bytes"] is not None
    cells = [
        number(r["kv_bytes"]) if known else "unknown",
        f"{100 * r['kv_bytes'] / r['kv_bytes_16bit']:.1f}%" if known else "",
        f"{r['perplexity']:.3f}",
        f"{r['delta_perplexity']:+.3f}" if "delta_perplexity" in r else "",
        f"{100 * r['agreement']:.0f}%" if "agreement" in r else "",
        str(r.get("first_divergence", "")),
        (
            f"{100 * r['agreement_ours_none']:.0f}% (first {r['first_divergence_ours_none']})"
            if "agreement_ours_none" in r
            else ""
        ),
        f"{r['decode_tok_s']:.1f}",
        f"{r['prefill_s']:.2f}",
    ]
    return head + cells


def table(rows: list[dict], args, ours_mode: str | None) -> str:
    header = ["method", "engine", "mode", "KV bytes/token", "% of 16-bit", "perplexity"]
    header += ["Δ perplexity vs uncompressed", "greedy agreement", "first divergence"]
    header += [f"agreement with ours none ({ours_mode or 'not run'})"]
    header += ["decode tok/s", "prefill s"]
    lines = [harness.md_table(header, [table_row(r) for r in rows])]
    done = [r for r in rows if "error" not in r]
    text_tokens = done[0]["text_tokens"] if done else args.tokens
    prompt_tokens = done[0]["prompt_tokens"] if done else args.tokens - GREEDY_TOKENS
    lines.append(
        f"\n{args.threads} threads. Perplexity over the first {text_tokens} tokens of "
        f"bench/data/english.txt; greedy: {GREEDY_TOKENS} tokens after its first "
        f"{prompt_tokens}, compared position by position with the uncompressed run of the "
        "same engine and mode (first divergence 128: none); prefill: the prompt to its "
        "first token. KV bytes per token: all layers, K and V; 16-bit is "
        "layers x 2 x KV heads x head dim x 2 bytes. Ours paged: paged_attn_context_len "
        f"{PAGED_CONTEXT_LEN}; llama.cpp: flash attention, n_ctx {args.tokens + 512}, "
        "its sliding-window layers keeping every token (full-size SWA cache), as ours do."
    )
    if text_tokens < args.tokens:
        lines.append(
            f"The text has only {text_tokens} tokens, fewer than the {args.tokens} asked "
            "for; all of it was used."
        )
    mismatched = [r["method"] for r in done if r.get("same_ids_as_ours") is False]
    if mismatched:
        lines.append(
            "llama.cpp tokenizes the text differently from ours; it was fed our token ids."
        )
    return "\n".join(lines)


def report(row: dict) -> None:
    print(json.dumps({k: v for k, v in row.items() if k != "ids"}), file=sys.stderr)


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--tokens", type=int, default=4096, help="context: text tokens scored")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--modes", nargs="*", default=MODES, choices=MODES)
    parser.add_argument(
        "--peer-types", nargs="*", default=list(PEER_TYPES), choices=list(PEER_TYPES)
    )
    harness.add_peers_python(parser, "llama-cpp-python")
    parser.add_argument("--child-ours", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--child-llama", choices=list(PEER_TYPES), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--ids", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_ours:
        row = measure_ours(args.child_ours, args.mode, args.gguf, args.threads, args.tokens)
        print(json.dumps(row))
        return
    if args.child_llama:
        row = measure_llama(args.child_llama, args.gguf, args.threads, args.tokens, args.ids)
        print(json.dumps(row))
        return
    gguf = harness.default_gguf()
    rows = []
    for mode in args.modes:
        for method in reference_first(args.methods, "none"):
            rows.append(run_ours_child(method, mode, gguf, args))
            report(rows[-1])
    ours_ids = next((r["ids"] for r in rows if "ids" in r), None)
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "ids.json"
        if ours_ids is not None:
            ids_file.write_text(json.dumps(ours_ids))
        if args.peer_types:
            for kind in reference_first(args.peer_types, "f16"):
                rows.append(run_llama_child(kind, gguf, args, ids_file))
                report(rows[-1])
    ours_mode = args.modes[0] if args.modes else None
    compare(rows, ours_mode)
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k not in ("ids", "tokens")}))
    harness.publish(table(rows, args, ours_mode), args.markdown)


if __name__ == "__main__":
    main()
