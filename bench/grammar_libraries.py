"""Constrained-decoding libraries on the default model's 262k-token vocabulary: xgrammar
against llguidance, the choice issue 22 asks to make by measurement.

A step is: every row's mask filled, the masks applied to float32 logits (by one plain
torch kernel for both, `apply_bitmask`), every matcher advanced by one token.

Cold, each library in a fresh process of its own (neither gains from the other's caches,
torch's compile cache included): its import, its view of the tokenizer (built once per
model), its own mask-applying kernel's first calls; then per JSON schema in turn, the
compile plus first mask (the first schema's carries any one-time lazy set-up), the whole
constrained run of the first valid instance at batch 1 (its matcher made, then every step
to the end token included), and the mean step at batch 16 through the library's batched
API (xgrammar's BatchGrammarMatcher, llguidance's LLExecutor, each with --threads
threads), one fresh matcher per row.

Warm, both in this process: the compile plus first mask, the mean step at batch 1 and 16
row by row, and correctness: valid instances admitted token by token to the end, invalid
ones (a missing property, a bound, a pattern, an extra property) refused somewhere.

Each number is the least of REPEATS (processes for the cold ones).

Neither library is a dependency of the project yet; run it in a venv that has them and
the project with its default model:

    pip install xgrammar llguidance transformers -e '.[default-model]'
    python bench/grammar_libraries.py [--threads 2] [--markdown FILE]
"""

import functools
import json
import os
import sys
import tempfile
import time

import harness

# The default model's end tokens (<eos>, <end_of_turn>): both libraries end on either.
EOS_TOKENS = [1, 106]
# Each number is the least of this many: fresh processes per library for the cold ones,
# calls or walks for the warm ones. The least, not the median: on a shared 2-core machine
# another process's load slows a 2-thread step manifold, and the least is the run it
# disturbed least.
REPEATS = 5

SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "bounded array of enums": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 4,
    },
    "pattern and numbers": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "note": {"type": "string", "maxLength": 30},
        },
        "required": ["id", "score"],
        "additionalProperties": False,
    },
}
# Valid instances of each (the first: the tokens the per-step timing walks through) and
# invalid ones, as compact JSON text: a correct mask admits every valid one to the end
# and refuses some token of every invalid one.
VALID = {
    "nested object": [
        '{"name":"Ada","age":36,"address":{"city":"London","zip":"N1"}}',
        '{"name":"","age":0,"address":{"city":"Rome"}}',
        '{"name":"Bo","age":150,"address":{"zip":"1","city":"Oslo"}}',
    ],
    "bounded array of enums": ['["red","blue","green"]', '["blue"]', '["red","red","red","red"]'],
    "pattern and numbers": [
        '{"id":"ABC-1234","score":9.5,"tags":["a","bc"]}',
        '{"id":"XYZ-0000","score":-1e3}',
        '{"score":0,"id":"QQQ-9999","note":"fine"}',
    ],
}
INVALID = {
    "nested object": [
        '{"name":"Ada","age":36}',  # address missing
        '{"name":"Ada","age":200,"address":{"city":"X"}}',  # age above its maximum
        '{"name":"Ada","age":3,"address":{"city":"X"},"extra":1}',  # no other property
    ],
    "bounded array of enums": ["[]", '["red","pink"]', '["red","red","red","red","red"]'],
    "pattern and numbers": [
        '{"id":"AB-1234","score":1}',  # id against its pattern
        '{"id":"ABC-1234"}',  # score missing
        '{"id":"ABC-1234","score":1,"tags":["much too long"]}',  # a tag past 8 characters
    ],
}


@functools.cache
def tokenizer_dir():
    """The directory of the default model's tokenizer as transformers saves it, converted
    once and cached by spnl_backend: what both libraries read (found once per process,
    before any timing)."""
    from spnl_backend.loader.default_model import default_model_path
    from spnl_backend.loader.tokenizer import gguf_tokenizer_dir

    return gguf_tokenizer_dir(default_model_path())


def load_tokenizer():
    """The default model's tokenizer as a transformers tokenizer (xgrammar reads it; both
    walks tokenize with it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir())


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int, threads: int) -> None:
        import xgrammar as xgr

        self.xgr, self.threads = xgr, threads
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab, stop_token_ids=EOS_TOKENS
        )
        self.batcher = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(
            self.info, max_threads=self.threads, cache_enabled=False
        )
        return compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled, count: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(count)]

    def bitmask(self, rows: int, vocab: int):
        return self.xgr.allocate_token_bitmask(rows, vocab)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accept_batch(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class Llguidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int, threads: int) -> None:
        import llguidance
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        # The fast way, the engine's: from tokenizer.json's text (llguidance.hf's way,
        # through the transformers tokenizer, took 7 s on this vocabulary).
        text = (tokenizer_dir() / "tokenizer.json").read_text()
        self.tokenizer = llguidance.LLTokenizer(text, eos_token=EOS_TOKENS)
        if self.tokenizer.vocab_size != vocab:
            raise ValueError(f"llguidance sees {self.tokenizer.vocab_size} tokens, not {vocab}")
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)  # compiles the grammar
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matchers(self, grammar, count: int) -> list:
        return [self.ll.LLMatcher(self.tokenizer, grammar) for _ in range(count)]

    def bitmask(self, rows: int, vocab: int):
        return self.llt.allocate_token_bitmask(rows, vocab)

    def fill(self, matcher, bitmask, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: list, bitmask) -> None:
        rows = [(matcher, row) for row, matcher in enumerate(matchers)]
        self.llt.fill_next_token_bitmask_par(self.executor, rows, bitmask)

    def apply(self, logits, bitmask) -> None:
        # llguidance.torch's kernel is torch.compile'd: its first call compiles (seconds).
        self.llt.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accept_batch(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self.llt.consume_token_par(self.executor, list(zip(matchers, tokens, strict=True)))

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


LIBRARIES = {library.name: library for library in (Xgrammar, Llguidance)}


def token_ids(hf, text: str) -> list[int]:
    return hf(text, add_special_tokens=False)["input_ids"]


@functools.cache
def _bits():
    """Each byte value's 8 bits, lowest first, as booleans."""
    import torch

    return ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


def apply_bitmask(logits, bitmask) -> None:
    """Set the logits of the tokens a bitmask refuses to -inf, in place: one plain torch
    kernel for both libraries (their bitmasks share a layout: int32 words, bit j of word
    w for token 32w + j), so that a step's time differs by the library's own work only.
    (xgrammar's kernel is about as fast; llguidance.torch's is torch.compile'd, which
    costs seconds on its first calls, shown apart.)"""
    import torch

    rows, vocab = logits.shape
    allowed = _bits()[bitmask.view(torch.uint8).long()].view(rows, -1)[:, :vocab]
    logits.masked_fill_(~allowed, float("-inf"))


def step_ms(library, compiled, tokens: list[int], batch: int, vocab: int) -> float:
    """Mean time of one decode step's masking over ``tokens`` at ``batch`` rows, row by
    row."""
    import torch

    matchers = library.matchers(compiled, batch)
    bitmask = library.bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    start = time.perf_counter()
    for token in tokens:
        for row, matcher in enumerate(matchers):
            library.fill(matcher, bitmask, row)
        apply_bitmask(logits, bitmask)
        for matcher in matchers:
            if not library.accept(matcher, token):
                raise RuntimeError(f"{library.name} refused a token of a valid instance")
    return (time.perf_counter() - start) * 1000 / len(tokens)


def batched_step_ms(library, compiled, tokens: list[int], batch: int, vocab: int) -> tuple:
    """Mean time of one decode step over ``tokens`` at ``batch`` rows through the
    library's batched API, and the mean of its mask filling alone."""
    import torch

    matchers = library.matchers(compiled, batch)
    bitmask = library.bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    filling = 0.0
    start = time.perf_counter()
    for token in tokens:
        filled = time.perf_counter()
        library.fill_batch(matchers, bitmask)
        filling += time.perf_counter() - filled
        apply_bitmask(logits, bitmask)
        if not all(library.accept_batch(matchers, [token] * batch)):
            raise RuntimeError(f"{library.name} refused a token of a valid instance")
    total = time.perf_counter() - start
    return total * 1000 / len(tokens), filling * 1000 / len(tokens)


def walks(library, compiled, text: str, hf) -> bool:
    """Whether the mask admits ``text``'s tokens one by one and then the end (EOS)."""
    import torch

    (matcher,) = library.matchers(compiled, 1)
    vocab = len(hf)
    bitmask = library.bitmask(1, vocab)
    for token in [*token_ids(hf, text), hf.eos_token_id]:
        logits = torch.zeros(1, vocab)
        library.fill(matcher, bitmask, 0)
        apply_bitmask(logits, bitmask)
        if logits[0, token] == float("-inf") or not library.accept(matcher, token):
            return False
    return True


def decisions(library, compiled, name: str, hf) -> tuple[int, int]:
    """Right decisions: valid texts admitted, invalid ones refused."""
    admitted = sum(walks(library, compiled, text, hf) for text in VALID[name])
    refused = sum(not walks(library, compiled, text, hf) for text in INVALID[name])
    return admitted, refused


def first_mask(library, schema: dict, vocab: int) -> None:
    """Compile ``schema`` and compute its first mask (a library may compile lazily)."""
    (matcher,) = library.matchers(library.compile(schema), 1)
    library.fill(matcher, library.bitmask(1, vocab), 0)


def apply_first_ms(library, vocab: int) -> float:
    """The library's mask-applying kernel's first calls, at batch 1 and then 16 (a
    torch.compile'd kernel compiles on its first call and again for a second shape)."""
    import torch

    total = 0.0
    for batch in (1, 16):
        logits, bitmask = torch.zeros(batch, vocab), library.bitmask(batch, vocab)
        total += harness.seconds(lambda: library.apply(logits, bitmask))  # noqa: B023
    return 1000 * total


# ---- cold: one library in a fresh process -------------------------------------------------


def cold_run(library, compiled, tokens: list[int], vocab: int) -> tuple[float, float]:
    """A request's constrained run at batch 1: its matcher made, then every step (the
    mask filled and applied, the matcher advanced) through ``tokens``; the whole and its
    mask filling alone, in ms."""
    import torch

    start = time.perf_counter()
    (matcher,) = library.matchers(compiled, 1)
    bitmask = library.bitmask(1, vocab)
    logits = torch.randn(1, vocab)
    filling = 0.0
    for token in tokens:
        filled = time.perf_counter()
        library.fill(matcher, bitmask, 0)
        filling += time.perf_counter() - filled
        apply_bitmask(logits, bitmask)
        if not library.accept(matcher, token):
            raise RuntimeError(f"{library.name} refused a token of a valid instance")
    if not library.done(matcher):
        raise RuntimeError(f"{library.name} did not end on the end token")
    return (time.perf_counter() - start) * 1000, filling * 1000


def cold(name: str, threads: int) -> dict:
    """One library measured cold in this (fresh) process."""
    import torch

    torch.set_num_threads(threads)
    hf = load_tokenizer()  # the engine holds it already: not counted
    vocab = len(hf)
    start = time.perf_counter()
    __import__(name)
    imported = time.perf_counter() - start
    library = LIBRARIES[name](hf, vocab, threads)
    setup = time.perf_counter() - start - imported
    result = {
        "library": name,
        "vocab": vocab,
        "import_s": imported,
        "setup_s": setup,
        "apply_first_ms": apply_first_ms(library, vocab),
        "schemas": [],
    }
    for schema_name, schema in SCHEMAS.items():
        tokens = [*token_ids(hf, VALID[schema_name][0]), hf.eos_token_id]
        start = time.perf_counter()
        compiled = library.compile(schema)
        (matcher,) = library.matchers(compiled, 1)
        library.fill(matcher, library.bitmask(1, vocab), 0)
        first_mask_ms = (time.perf_counter() - start) * 1000
        run_ms, run_fill_ms = cold_run(library, compiled, tokens, vocab)
        batched_ms, batched_fill_ms = batched_step_ms(library, compiled, tokens[:-1], 16, vocab)
        result["schemas"].append(
            {
                "schema": schema_name,
                "first_mask_ms": first_mask_ms,
                "run_ms": run_ms,
                "run_fill_ms": run_fill_ms,
                "run_tokens": len(tokens),
                "batched16_ms": batched_ms,
                "batched16_fill_ms": batched_fill_ms,
            }
        )
        print(json.dumps(result["schemas"][-1]), file=sys.stderr)
    return result


def least_result(results: list):
    """Each number the least of its values over ``results`` (alike in everything else)."""
    first = results[0]
    if isinstance(first, dict):
        return {key: least_result([r[key] for r in results]) for key in first}
    if isinstance(first, list):
        return [least_result(list(items)) for items in zip(*results, strict=True)]
    if isinstance(first, float):
        return min(results)
    return first


def cold_tables(results: list[dict]) -> str:
    setup = [
        [
            r["library"],
            f"{1000 * r['import_s']:,.0f} ms",
            f"{r['setup_s']:.2f} s",
            f"{r['apply_first_ms']:,.1f} ms",
        ]
        for r in results
    ]
    rows = [
        [
            r["library"],
            s["schema"],
            f"{s['first_mask_ms']:,.1f} ms",
            f"{s['run_ms']:,.1f} ms ({s['run_tokens']} steps)",
            f"{s['run_fill_ms']:,.1f} ms",
            f"{s['batched16_ms']:.2f} ms",
            f"{s['batched16_fill_ms']:.2f} ms",
        ]
        for r in results
        for s in r["schemas"]
    ]
    return (
        harness.md_table(
            [
                "library",
                "import",
                "tokenizer set-up (once)",
                "own apply kernel, first calls (batch 1, 16)",
            ],
            setup,
        )
        + "\n\n"
        + harness.md_table(
            [
                "library",
                "schema (in this order)",
                "compile + first mask",
                "run at batch 1",
                "of which mask filling",
                "batched step, batch 16",
                "of which mask filling",
            ],
            rows,
        )
    )


# ---- warm: both in this process -----------------------------------------------------------


def measure(library_class, hf, vocab: int, threads: int) -> list[list]:
    start = time.perf_counter()
    library = library_class(hf, vocab, threads)
    setup = time.perf_counter() - start
    rows = []
    for name, schema in SCHEMAS.items():
        compile_ms = 1000 * min(
            harness.seconds(lambda s=schema: first_mask(library, s, vocab)) for _ in range(REPEATS)
        )
        compiled = library.compile(schema)
        tokens = token_ids(hf, VALID[name][0])
        one, sixteen = (
            min(step_ms(library, compiled, tokens, batch, vocab) for _ in range(REPEATS))
            for batch in (1, 16)
        )
        admitted, refused = decisions(library, compiled, name, hf)
        rows.append(
            [
                library.name,
                name,
                f"{setup:.2f} s",
                f"{compile_ms:,.1f} ms",
                f"{one:.2f} ms",
                f"{sixteen:.2f} ms",
                f"{admitted}/{len(VALID[name])}",
                f"{refused}/{len(INVALID[name])}",
            ]
        )
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--child", choices=sorted(LIBRARIES), help="(internal) one cold run")
    args = parser.parse_args(argv)
    if args.child:
        # torch.compile's cache on disk would carry a kernel over from an earlier process.
        with tempfile.TemporaryDirectory(prefix="grammar-bench-") as compiled:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = compiled
            print(json.dumps(cold(args.child, args.threads)))
        return
    # The cold children first, before this process loads anything.
    command = [sys.executable, __file__, "--threads", args.threads, "--child"]
    # Interleaved, so that a load that comes and goes on the machine weighs on both.
    runs = [[harness.child_json([*command, name]) for name in LIBRARIES] for _ in range(REPEATS)]
    results = [least_result(list(each)) for each in zip(*runs, strict=True)]
    import torch

    torch.set_num_threads(args.threads)
    hf = load_tokenizer()
    vocab = len(hf)
    rows = []
    for library in LIBRARIES.values():
        rows += measure(library, hf, vocab, args.threads)
    header = [
        "library",
        "schema",
        "tokenizer set-up (once)",
        "compile + first mask",
        "mask step, batch 1",
        "mask step, batch 16",
        "valid admitted",
        "invalid refused",
    ]
    text = (
        f"{vocab:,}-token vocabulary, {args.threads} threads; a step: masks filled, "
        "applied to float32 logits, matchers advanced\n\n"
        f"Cold, each library in a fresh process (the least over {REPEATS} each)\n\n"
        + cold_tables(results)
        + f"\n\nWarm, both in one process, row by row (the least of {REPEATS})\n\n"
        + harness.md_table(header, rows)
    )
    harness.publish(text, args.markdown)


if __name__ == "__main__":
    main()
