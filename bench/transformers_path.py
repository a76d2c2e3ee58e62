"""The transformers path against the native one on the same synthetic Llama: prefill and decode.

    python bench/transformers_path.py [--threads 2] [--runs 3] [--prompt-tokens 256]
        [--tokens 64] [--hidden 512] [--layers 8] [--isq Q8_0] [--markdown FILE]

A random Llama (--hidden wide, --layers deep, 8 heads of 64, 2 KV heads, a vocabulary of
8,192) is written once as float32 safetensors; each path loads it on the CPU
(``MISTRALRS_MODEL_IMPL=native`` and ``=transformers``, float32, then with --isq on both)
and greedily completes a prompt of --prompt-tokens tokens to --tokens tokens, the prefix
cache off. Reported: the median of --runs after one untimed run, of the time to the first
token (the prefill) and of the decode rate after it (`Usage.ttft_s`, `decode_tok_s`).
"""

import harness


def synthetic_llama(hidden: int, layers: int):
    """The random Llama's directory, written once under the bench cache."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = harness.bench_cache("bench") / f"synthetic-llama-{hidden}x{layers}"
    if (path / "config.json").exists():
        return path
    vocab = {f"w{i}": i for i in range(8192)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="w1")
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    hf_tokenizer.save_pretrained(path)
    return path


def measure(path, implementation: str, args, isq: str | None) -> list:
    import torch

    torch.set_num_threads(args.threads)
    settings = dict(device="cpu", model_impl=implementation, prefix_cache_n=0)
    settings["num_threads"] = args.threads
    if isq:
        settings["isq"] = isq
    backend = harness.load_ours(path, **settings)
    prompt = " ".join(f"w{3 + i % 8000}" for i in range(args.prompt_tokens))
    usages = []
    for run in range(args.runs + 1):
        result = backend.generate(
            prompt, max_tokens=args.tokens, temperature=0, ignore_eos=True, seed=run
        )
        usages.append(result.usage)
    backend.close()
    timed = usages[1:]  # the first run warms up
    ttft = sorted(u.ttft_s for u in timed)[len(timed) // 2]
    decode = sorted(u.decode_tok_s for u in timed)[len(timed) // 2]
    return [implementation, isq or "none", f"{ttft * 1000:.0f}", f"{decode:.1f}"]


def main() -> None:
    parser = harness.arguments(__doc__, runs=True)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--isq", default="Q8_0", help="the ISQ type of the second pair")
    args = parser.parse_args()
    path = synthetic_llama(args.hidden, args.layers)
    rows = [
        measure(path, implementation, args, isq)
        for isq in (None, args.isq)
        for implementation in ("native", "transformers")
    ]
    header = ["path", "ISQ", "prefill (ms)", "decode (tok/s)"]
    title = (
        f"synthetic Llama {args.hidden}x{args.layers}, prompt {args.prompt_tokens} tokens, "
        f"{args.tokens} generated, {args.threads} threads, median of {args.runs}"
    )
    harness.publish(title + "\n\n" + harness.md_table(header, rows), args.markdown)


if __name__ == "__main__":
    main()
