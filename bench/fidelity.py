"""Greedy fidelity on the default model: how long ours agrees with llama.cpp, and transformers.

    python bench/fidelity.py [--peers-python PATH] [--threads 2] [--tokens 32] [--markdown FILE]
    python bench/fidelity.py --check [--threads 2] [--settings cpu_matmul=float32 ...]
        [--markdown FILE]
    python bench/fidelity.py --perturb 1e-7 [--settings ...]

Without --check it records the peers' greedy tokens into tests/data/fidelity.json (the
fixture tests/test_fidelity.py checks ours against; CI has neither llama.cpp nor the time
for transformers), then runs the check. For each of the 16 prompts of
bench/batch_invariance.py, every engine is fed the same prompt token ids: ours, the raw
prompt with the BOS our tokenizer adds by default. Each peer also tokenizes the text
itself and the fixture says whether that gave the same ids (the run warns where not).

- llama.cpp (llama-cpp-python, run by --peers-python in a fresh process): --tokens greedy
  tokens, each the argmax of its logits (seed 0, temperature 0, --threads threads);
- transformers (float32, the GGUF dequantized, in a fresh process): ``generate`` with
  ``do_sample=False``, and the argmax at each position of llama.cpp's own tokens
  (teacher-forced: the prompt and llama.cpp's first j tokens give the (j+1)-th).

Each stops early at an end-of-generation token, which it keeps. --check loads the fixture
and ours (``harness.load_ours`` on the default GGUF, default settings), generates each
prompt greedily on its own, and prints per prompt the common-prefix lengths of ours and
llama.cpp, of transformers and llama.cpp, and of ours and transformers, with the totals.
It also prints the teacher-forced agreement: at how many of llama.cpp's positions ours,
and transformers, pick llama.cpp's token when fed llama.cpp's own prefix (one token's
arithmetic at a time, without the cascade a greedy divergence sets off).
--settings (field=value, as in code) loads ours with other settings, to see what moves it.
The criteria the tests assert are in tests/test_fidelity.py.

--perturb EPS generates the prompts twice with ours, the second time with every
embedding multiplied by (1 + EPS * noise) (standard normal noise, seeded per prompt): how
far greedy output moves when the arithmetic moves by a rounding error. It runs that for
ours as loaded (with --settings) and with float32 activations (cpu_matmul=float32).
"""

import argparse
import datetime
import hashlib
import json
import re
import shlex
import sys
import tempfile
from pathlib import Path

import harness

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "data" / "fidelity.json"
TOKENS = 32
PEERS = ("llama.cpp", "transformers")


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


# ---- the peers (each in a child process; llama.cpp's under --peers-python) ---------------


def llama_cpp_greedy(gguf: Path, threads: int, prompts: list[dict], tokens: int) -> dict:
    import llama_cpp
    import numpy as np

    llm = harness.load_llama_cpp(gguf, threads, 512)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)

    def next_token() -> int:  # temperature 0: the argmax of the last position's logits
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
        return int(np.argmax(logits))

    outputs = []
    for prompt in prompts:
        llm.reset()  # no prefix reuse from the previous prompt
        llm.eval(prompt["ids"])
        generated = [next_token()]
        while len(generated) < tokens and not llama_cpp.llama_vocab_is_eog(vocab, generated[-1]):
            llm.eval([generated[-1]])
            generated.append(next_token())
        own = llm.tokenize(prompt["text"].encode(), add_bos=True, special=False)
        outputs.append({"own_ids": own, "generated": generated})
    return {"version": f"llama-cpp-python {llama_cpp.__version__}", "outputs": outputs}


def transformers_greedy(gguf: Path, threads: int, prompts: list[dict], tokens: int) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt["ids"]])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                do_sample=False,
                top_p=None,
                top_k=None,
            )
        generated = out[0, ids.shape[1] :].tolist()
        own = tokenizer(prompt["text"]).input_ids
        llama = prompt["llama_cpp"]
        forced = torch.tensor([prompt["ids"] + llama[:-1]])
        with torch.inference_mode():
            logits = model(forced).logits[0, -len(llama) :]
        on_llama = logits.argmax(-1).tolist()
        outputs.append({"own_ids": own, "generated": generated, "on_llama": on_llama})
    version = f"transformers {transformers.__version__}, torch {torch.__version__}, float32"
    return {"version": version, "outputs": outputs}


CHILDREN = {"llama.cpp": llama_cpp_greedy, "transformers": transformers_greedy}


def run_peer(peer: str, python: str, gguf: Path, args, prompts_file: Path) -> dict:
    command = [python, __file__, "--child", peer, "--prompts", prompts_file, "--gguf", gguf]
    command += ["--threads", args.threads, "--tokens", args.tokens]
    return harness.child_json(command)


# ---- recording ------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def fixture_text(fixture: dict) -> str:
    """Indented JSON with every list of token ids on one line (a small, readable file)."""
    text = json.dumps(fixture, indent=1, ensure_ascii=False)
    return re.sub(r"\[[\d,\s]*\]", lambda m: json.dumps(json.loads(m.group())), text) + "\n"


def record(args, backend, gguf: Path) -> dict:
    from batch_invariance import PROMPTS  # imports spnl_backend: never in a peer's child

    prompts = [{"text": text, "ids": backend.tokenizer.encode(text)} for text in PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        peers = {}
        for peer in PEERS:  # llama.cpp first: transformers is also fed its tokens
            python = args.peers_python if peer == "llama.cpp" else sys.executable
            print(f"running {peer} ...", file=sys.stderr)
            peers[peer] = run_peer(peer, python, gguf, args, prompts_file)
            if peer == "llama.cpp":
                for prompt, output in zip(prompts, peers[peer]["outputs"], strict=True):
                    prompt["llama_cpp"] = output["generated"]
                prompts_file.write_text(json.dumps(prompts))
    tokenization = []
    for peer, result in peers.items():
        for prompt, output in zip(prompts, result["outputs"], strict=True):
            if output["own_ids"] != prompt["ids"]:
                tokenization.append(
                    {"engine": peer, "prompt": prompt["text"], "own_ids": output["own_ids"]}
                )
                print(
                    f"warning: {peer} tokenizes {prompt['text']!r} as {output['own_ids']}, "
                    f"ours as {prompt['ids']}; it was fed ours",
                    file=sys.stderr,
                )
    command = ["python", "bench/fidelity.py", *sys.argv[1:]]
    fixture = {
        "about": (
            "Greedy tokens of the peers on the default GGUF, each fed the prompt ids "
            "(ours: the raw prompt with BOS); written by bench/fidelity.py, checked by "
            "tests/test_fidelity.py."
        ),
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "command": shlex.join(command),
        "gguf": {"name": gguf.name, "bytes": gguf.stat().st_size, "sha256": sha256(gguf)},
        "engines": {peer: result["version"] for peer, result in peers.items()},
        "settings": {"tokens": args.tokens, "threads": args.threads, "greedy": True},
        # Empty: every peer's own tokenization of every prompt equals ours.
        "tokenization_differences": tokenization,
        "prompts": [
            {
                "prompt": prompt["text"],
                "prompt_ids": prompt["ids"],
                "llama_cpp": peers["llama.cpp"]["outputs"][i]["generated"],
                "transformers": peers["transformers"]["outputs"][i]["generated"],
                "transformers_on_llama_cpp": peers["transformers"]["outputs"][i]["on_llama"],
            }
            for i, prompt in enumerate(prompts)
        ],
    }
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(fixture_text(fixture))
    print(f"wrote {FIXTURE}", file=sys.stderr)
    return fixture


# ---- checking ours --------------------------------------------------------------------------


def teacher_forced(backend, case: dict) -> list[int]:
    """Ours' argmax at each of llama.cpp's positions, fed the prompt and llama.cpp's tokens
    before it. Run before any generation of the prompt: a prefix-cache hit would leave out
    the first rows."""
    llama = case["llama_cpp"]
    logits = harness.our_logits(backend, case["prompt_ids"] + llama[:-1])
    if logits.shape[0] < len(llama):
        raise RuntimeError(f"{case['prompt']!r}: the prefix cache served llama.cpp's positions")
    return logits[-len(llama) :].argmax(-1).tolist()


def agreeing(picks: list[int], tokens: list[int]) -> int:
    """At how many positions ``picks`` chose ``tokens``' token."""
    return sum(a == b for a, b in zip(picks, tokens, strict=True))


def check(backend, fixture: dict, settings: list[str]) -> str:
    cases = fixture["prompts"]
    forced = [teacher_forced(backend, case) for case in cases]  # before any generation
    rows = []
    totals = [0] * 6
    at_least = 0
    for i, case in enumerate(cases):
        ids = backend.tokenizer.encode(case["prompt"])
        if ids != case["prompt_ids"]:
            print(f"warning: ours now tokenizes {case['prompt']!r} as {ids}", file=sys.stderr)
        ours = backend.generate(
            case["prompt"], max_tokens=len(case["llama_cpp"]), temperature=0
        ).token_ids
        llama, hf = case["llama_cpp"], case["transformers"]
        counts = [
            len(llama),
            common_prefix(ours, llama),
            common_prefix(hf, llama),
            common_prefix(ours, hf),
            agreeing(forced[i], llama),
            agreeing(case["transformers_on_llama_cpp"], llama),
        ]
        at_least += counts[1] >= counts[2]
        totals = [t + c for t, c in zip(totals, counts, strict=True)]
        rows.append([i, repr(case["prompt"]).replace("|", "\\|"), *counts])
    rows.append(["total", "", *totals])
    header = [
        "#",
        "prompt",
        "llama.cpp tokens",
        "ours~llama",
        "hf~llama",
        "ours~hf",
        "ours on llama's",
        "hf on llama's",
    ]
    platform = backend.platform
    return (
        f"{harness.md_table(header, rows)}\n\n"
        f"Common-prefix lengths of the greedy tokens (a~b: how many leading tokens a and b "
        f"share); hf: transformers float32. Ours agrees with llama.cpp at least as long as "
        f"transformers does on {at_least} of {len(cases)} prompts. Teacher-forced (the last "
        f"two columns): at how many of llama.cpp's positions the engine, fed llama.cpp's "
        f"own prefix, picks llama.cpp's token. Fixture of {fixture['date']}: "
        f"{', '.join(fixture['engines'].values())}. Ours: "
        f"{' '.join(settings) or 'default settings'}; kernels {platform.kernels}, "
        f"cpu_matmul {platform.cpu_matmul}, cpu_gemm {platform.cpu_gemm}."
    )


# ---- how far a rounding error moves greedy output -------------------------------------------


def perturbed(backend, eps: float):
    """A context in which ``backend``'s embeddings are multiplied by (1 + eps * noise),
    the noise seeded by the step's token ids (the same for a prompt every time)."""
    import contextlib

    import torch

    def hook(module, inputs, output):
        (ids,) = inputs
        generator = torch.Generator().manual_seed(int(ids.sum()) + ids.numel())
        noise = torch.randn(output.shape, generator=generator, dtype=output.dtype)
        return output * (1 + eps * noise)

    @contextlib.contextmanager
    def applied():
        handle = backend.model.model.embed_tokens.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    return applied()


def perturbation(gguf: Path, fixture: dict, eps: float, settings: dict) -> list:
    """Common-prefix totals of ours against ours perturbed, and of each against llama.cpp."""
    backend = harness.load_ours(gguf, prefix_cache_n=0, **settings)
    cases = fixture["prompts"]

    def greedy() -> list[list[int]]:
        return [
            backend.generate(c["prompt"], max_tokens=len(c["llama_cpp"]), temperature=0).token_ids
            for c in cases
        ]

    plain = greedy()
    with perturbed(backend, eps):
        moved = greedy()
    backend.close()
    shared = [common_prefix(a, b) for a, b in zip(plain, moved, strict=True)]
    to_llama = [
        sum(common_prefix(out, c["llama_cpp"]) for out, c in zip(outs, cases, strict=True))
        for outs in (plain, moved)
    ]
    return [
        sum(shared),
        sum(s == len(c["llama_cpp"]) for s, c in zip(shared, cases, strict=True)),
        *to_llama,
    ]


def perturbation_report(gguf: Path, fixture: dict, eps: float, settings: list[str]) -> str:
    pairs = dict(pair.split("=", 1) for pair in settings)
    rows = []
    for label, extra in (("as loaded", {}), ("float32 activations", {"cpu_matmul": "float32"})):
        chosen = {**pairs, **extra}
        named = " ".join(f"{k}={v}" for k, v in chosen.items()) or "default settings"
        rows.append([f"{label} ({named})", *perturbation(gguf, fixture, eps, chosen)])
    total = sum(len(c["llama_cpp"]) for c in fixture["prompts"])
    header = [
        "ours",
        f"ours~ours perturbed (of {total})",
        f"prompts unchanged (of {len(fixture['prompts'])})",
        "ours~llama",
        "perturbed~llama",
    ]
    return (
        f"{harness.md_table(header, rows)}\n\n"
        f"Greedy common-prefix totals on the fixture's prompts, ours against ours with every "
        f"embedding multiplied by (1 + {eps:g} * noise), and each against llama.cpp."
    )


def main() -> None:
    parser = harness.arguments(__doc__)
    harness.add_peers_python(parser, "llama-cpp-python")
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--check", action="store_true", help="only check ours on the fixture")
    parser.add_argument("--settings", nargs="*", default=[], help="ours: field=value, as in code")
    parser.add_argument(
        "--perturb", type=float, metavar="EPS", help="how far a relative error EPS moves ours"
    )
    parser.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        prompts = json.loads(args.prompts.read_text())
        print(json.dumps(CHILDREN[args.child](args.gguf, args.threads, prompts, args.tokens)))
        return
    import torch

    torch.set_num_threads(args.threads)
    gguf = harness.default_gguf()
    if args.perturb is not None:
        fixture = json.loads(FIXTURE.read_text())
        report = perturbation_report(gguf, fixture, args.perturb, args.settings)
        harness.publish(report, args.markdown)
        return
    backend = harness.load_ours(gguf, **dict(pair.split("=", 1) for pair in args.settings))
    if args.check:
        fixture = json.loads(FIXTURE.read_text())
        if fixture["gguf"]["bytes"] != gguf.stat().st_size:
            sys.exit(f"the fixture was recorded on another GGUF: {fixture['gguf']}")
    else:
        fixture = record(args, backend, gguf)
    harness.publish(check(backend, fixture, args.settings), args.markdown)


if __name__ == "__main__":
    main()
