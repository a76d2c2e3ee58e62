"""Constrained-decoding libraries on the default model's 262k-token vocabulary: xgrammar
against llguidance, the choice issue 22 asks to make by measurement.

For each library and JSON schema: the time to build its view of the tokenizer (once),
to compile the schema and compute its first mask (cold, median of 3: a library may compile
lazily), and per decode step to compute the token masks of a batch (each row its own
matcher), apply them to float32 logits and advance every matcher by one token, at batch
1 and 16; and correctness: valid instances admitted token by token to the end, invalid
ones (a missing property, a bound, a pattern, an extra property) refused somewhere.

Neither library is a dependency of the project yet; run it in a venv that has them:

    pip install xgrammar llguidance transformers
    python bench/grammar_libraries.py [--threads 2] [--markdown FILE]
"""

import json
import statistics
import sys
import time

import harness

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


def load_tokenizer():
    """The default model's tokenizer as a transformers tokenizer (what both libraries
    read), from the conversion spnl_backend caches."""
    from transformers import AutoTokenizer

    from spnl_backend.loader.tokenizer import gguf_tokenizer_dir

    return AutoTokenizer.from_pretrained(gguf_tokenizer_dir(harness.default_gguf()))


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled, count: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(count)]

    def bitmask(self, rows: int, vocab: int):
        return self.xgr.allocate_token_bitmask(rows, vocab)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class Llguidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)

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

    def apply(self, logits, bitmask) -> None:
        self.llt.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


def step_ms(library, compiled, tokens: list[int], batch: int, vocab: int) -> float:
    """Mean time of one decode step's masking over ``tokens`` at ``batch`` rows."""
    import torch

    matchers = library.matchers(compiled, batch)
    bitmask = library.bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    start = time.perf_counter()
    for token in tokens:
        for row, matcher in enumerate(matchers):
            library.fill(matcher, bitmask, row)
        library.apply(logits, bitmask)
        for matcher in matchers:
            if not library.accept(matcher, token):
                raise RuntimeError(f"{library.name} refused a token of a valid instance")
    return (time.perf_counter() - start) * 1000 / len(tokens)


def walks(library, compiled, text: str, hf) -> bool:
    """Whether the mask admits ``text``'s tokens one by one and then the end (EOS)."""
    import torch

    (matcher,) = library.matchers(compiled, 1)
    vocab = len(hf)
    bitmask = library.bitmask(1, vocab)
    for token in [*hf(text, add_special_tokens=False)["input_ids"], hf.eos_token_id]:
        logits = torch.zeros(1, vocab)
        library.fill(matcher, bitmask, 0)
        library.apply(logits, bitmask)
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


def measure(library_class, hf, vocab: int) -> list[list]:
    start = time.perf_counter()
    library = library_class(hf, vocab)
    setup = time.perf_counter() - start
    rows = []
    for name, schema in SCHEMAS.items():
        compile_ms = 1000 * statistics.median(
            harness.seconds(lambda s=schema: first_mask(library, s, vocab)) for _ in range(3)
        )
        compiled = library.compile(schema)
        tokens = hf(VALID[name][0], add_special_tokens=False)["input_ids"]
        one = step_ms(library, compiled, tokens, 1, vocab)
        sixteen = step_ms(library, compiled, tokens, 16, vocab)
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
    args = harness.arguments(__doc__).parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    hf = load_tokenizer()
    vocab = len(hf)
    rows = []
    for library in (Xgrammar, Llguidance):
        rows += measure(library, hf, vocab)
    header = [
        "library",
        "schema",
        "tokenizer set-up (once)",
        "compile (cold)",
        "mask step, batch 1",
        "mask step, batch 16",
        "valid admitted",
        "invalid refused",
    ]
    title = (
        f"{vocab:,}-token vocabulary, {args.threads} threads; "
        "a step: masks filled, applied, advanced"
    )
    harness.publish(title + "\n\n" + harness.md_table(header, rows), args.markdown)


if __name__ == "__main__":
    main()
