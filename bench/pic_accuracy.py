"""Does reusing documents change the answer? Multi-document questions answered from a
plain prompt and from PIC prompts whose documents the pool already holds, scored against
the plain prompt's own answer and against the truth.

    python bench/pic_accuracy.py [--docs 4 8 16] [--words 50 200 1000] [--questions 10]
        [--rules exact tokens relaxed] [--recompute 0 0.05 0.1 0.15 0.25]
        [--recompute-rules tokens] [--recompute-positions after_prefix sequential]
        [--recompute-select first deviation] [--gguf GGUF] [--markdown FILE]

Each question is made up (places, people and numbers no model knows): half need one
document (a vault's code), half need two (one document says who holds an archive's key,
another that person's badge number); every document carries facts of the same shapes
about other places and people, so that the right one must be found. For each question,
on the default model (or ``--gguf``), greedy, 16 tokens:

- the plain prompt: the instruction, the documents in a shuffled order and the question,
  as one causal prompt of the same tokens, computed whole (no cache);
- for each reuse rule (``MISTRALRS_PIC_REUSE``: ``exact``, ``tokens`` (spnl's),
  ``relaxed``): the documents first sent after another instruction, with another
  question, in another order (so the pool holds them, as spnl's queries leave them),
  then this question's PIC prompt: spnl's rule and relaxed reuse take the documents from
  the pool; exact reuse, whose keys chain the instruction, computes them again (PIC
  attention all the same);
- for each recompute fraction (``MISTRALRS_PIC_RECOMPUTE``) under each of
  ``--recompute-rules`` (spnl's by default) and each of ``--recompute-positions``
  (``MISTRALRS_PIC_POSITIONS``) and each of ``--recompute-select``
  (``MISTRALRS_PIC_RECOMPUTE_SELECT``): the same, with that fraction of each document's
  tokens computed again with full attention: its first ones, or as many of the group's
  tokens chosen by their deviation (CacheBlend's rule).

Reported per size and rule: the answer equal to the plain prompt's (the greedy text's
first sentence, which completes the primed answer, exact match: the model babbles on
after it), token F1 of the whole greedy text against the plain prompt's, right against
the truth (the plain prompt's too), the TTFT against the plain prompt's, and the share of
document tokens computed again (0 without selective recomputation). Targets (issue 43):
the answer equal to the plain prompt's in at least 95% of questions, TTFT at most 0.3x
the plain prompt's at 1,000-word documents.
"""

import itertools
import random
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import harness
from pic import blocks, f1, flat, pic, plain

RULES = ("exact", "tokens", "relaxed")
SYSTEM = "Answer the question from the documents. Be brief."
OTHER_SYSTEM = "You are a careful assistant. Use only the documents given below."
SYLLABLES = ("var", "nol", "quil", "bre", "tam", "ost", "ivo", "sen", "dra", "mek", "ul", "zor")
FILLER = (
    "the committee met again on tuesday to review the harbor schedule and the new budget",
    "several volunteers repaired the old fence near the library before the rain arrived",
    "a report on regional trade was filed with the office of the district clerk",
    "the bakery on the corner changed its hours after the bridge was closed for repairs",
    "students from the technical school presented a model of the river lock",
    "the museum lent two paintings to a gallery in the capital for the summer",
    "after a long debate the council agreed to plant trees along the main road",
    "the ferry ran late because of fog and the passengers waited in the small station",
    "a local choir rehearsed in the town hall every thursday evening",
    "inspectors found the grain stores dry and well kept this season",
)


@dataclass(frozen=True)
class Question:
    docs: list[str]  # in the order the question's prompts give them
    question: str
    answer_start: str  # the answer's first words, so that the model completes a copy
    truth: str
    hops: int  # documents the answer needs


def name(rng: random.Random, parts: int = 2) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def filler(words: int, rng: random.Random) -> list[str]:
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(rng.choice(FILLER).capitalize() + ".")
    return sentences


def document(index: int, words: int, facts: list[str], rng: random.Random) -> str:
    """A document of about ``words`` words with ``facts`` at random places in it."""
    sentences = filler(words, rng)
    for fact in facts:
        sentences.insert(rng.randrange(len(sentences) + 1), fact)
    return f"Document {index}: " + " ".join(sentences) + "\n\n"


def question(docs: int, words: int, hops: int, rng: random.Random) -> Question:
    """``docs`` documents, each with a vault's code and an archive's key holder and a
    badge number; the question asks for one vault's code (``hops`` 1) or the badge
    number of one archive's key holder (``hops`` 2, held in another document)."""
    places = [name(rng) for _ in range(docs)]
    people = [name(rng, 3) for _ in range(docs)]
    codes = [str(rng.randrange(1000, 10000)) for _ in range(docs)]
    badges = [str(rng.randrange(100, 1000)) for _ in range(docs)]
    holder = rng.sample(range(docs), docs)  # archive i's key is held by person holder[i]
    facts = [[] for _ in range(docs)]
    for i in range(docs):
        facts[i].append(f"The vault of {places[i]} opens with the code {codes[i]}.")
        facts[i].append(f"The key to the {places[i]} archive is held by {people[holder[i]]}.")
        # the holder's badge in the next document: the second hop is always another one
        badge = f"The badge number of {people[holder[i]]} is {badges[holder[i]]}."
        facts[(i + 1) % docs].append(badge)
    texts = [document(i, words, facts[i], rng) for i in range(docs)]
    rng.shuffle(texts)
    target = rng.randrange(docs)
    if hops == 1:
        return Question(
            texts,
            f"What is the code of the vault of {places[target]}?",
            f"The code of the vault of {places[target]} is",
            codes[target],
            1,
        )
    return Question(
        texts,
        f"What is the badge number of the person who holds the key to the "
        f"{places[target]} archive?",
        "The badge number is",
        badges[holder[target]],
        2,
    )


def answers(backends: dict, cold, asked: Question, tokens: int) -> dict:
    """The plain prompt's answer and each rule's, the documents reused."""
    pieces = blocks(cold, asked.docs, asked.question, asked.answer_start, SYSTEM)
    found = {"plain": plain(cold, flat(pieces), tokens)}
    other = "Which documents mention a ferry?"
    for rule, backend in backends.items():
        # In the pool now, after another instruction: spnl's rule and relaxed reuse take
        # them as they are; exact reuse computes them again (its keys chain the prefix).
        pic(backend, blocks(backend, asked.docs[::-1], other, "", OTHER_SYSTEM))
        found[rule] = pic(
            backend, blocks(backend, asked.docs, asked.question, asked.answer_start, SYSTEM), tokens
        )
    return found


def first_sentence(text: str) -> str:
    """The text up to its first full stop (a number's decimal point is not one) or line."""
    return re.split(r"\.(?!\d)|\n", text.strip(), maxsplit=1)[0].strip()


def scored(found: dict, asked: Question) -> dict:
    reference = found["plain"]
    row = {"plain right": asked.truth in reference.text, "plain ttft": reference.usage.ttft_s}
    for rule, result in found.items():
        if rule == "plain":
            continue
        usage = result.usage
        plus = usage.pic_hit_tokens + usage.pic_miss_tokens
        row[rule] = {
            "same": first_sentence(result.text) == first_sentence(reference.text),
            "f1": f1(result.text, reference.text),
            "right": asked.truth in result.text,
            "ttft": usage.ttft_s,
            "hit": usage.pic_hit_tokens / plus if plus else 0.0,
            "recomputed": usage.pic_recomputed_tokens / plus if plus else 0.0,
        }
    return row


def run_size(backends, cold, docs: int, words: int, args, rng) -> list[dict]:
    rows = []
    for i in range(args.questions):
        asked = question(docs, words, 1 + i % 2, rng)
        rows.append(scored(answers(backends, cold, asked, args.tokens), asked))
    return rows


def summary(docs: int, words: int, rows: list[dict], rules: list[str]) -> list[list]:
    plain_ttft = statistics.median(r["plain ttft"] for r in rows)
    plain_right = sum(r["plain right"] for r in rows)
    lines = []
    for rule in rules:
        mine = [r[rule] for r in rows]
        ttft = statistics.median(m["ttft"] for m in mine)
        lines.append(
            [
                docs,
                words,
                rule,
                f"{sum(m['same'] for m in mine)}/{len(mine)}",
                f"{statistics.mean(m['f1'] for m in mine):.0f}",
                f"{sum(m['right'] for m in mine)}/{len(mine)} (plain {plain_right})",
                f"{ttft * 1000:,.0f} / {plain_ttft * 1000:,.0f} ms ({ttft / plain_ttft:.2f}x)",
                f"{statistics.mean(m['hit'] for m in mine):.0%}",
                f"{statistics.mean(m['recomputed'] for m in mine):.0%}",
            ]
        )
    return lines


HEADER = [
    "docs",
    "words per doc",
    "reuse rule (recomputation)",
    "answer = plain's",
    "F1 vs plain",
    "right (truth)",
    "TTFT reused / plain",
    "document tokens reused",
    "recomputed",
]


def recompute_label(
    rule: str, fraction: float, positions: str = "after_prefix", select: str = "first"
) -> str:
    """A configuration's name in the table: the rule, the positions where they are not
    the default, the fraction recomputed and how its tokens were chosen where not the
    first ones."""
    placed = "" if positions == "after_prefix" else f", {positions}"
    chosen = " by deviation" if select == "deviation" and fraction else ""
    return f"{rule}{placed}, {fraction:.0%} recomputed{chosen}"


def fits(backend, docs: int, words: int, context: int) -> bool:
    asked = question(docs, words, 2, random.Random(0))
    pieces = blocks(backend, asked.docs, asked.question, asked.answer_start, SYSTEM)
    return len(flat(pieces)) + 64 + docs * 32 < context


def main(argv: list[str] | None = None) -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--docs", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--words", type=int, nargs="+", default=[50, 200, 1000])
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--recompute", type=float, nargs="*", default=[0, 0.05, 0.1, 0.15, 0.25])
    parser.add_argument("--recompute-rules", nargs="*", choices=RULES, default=["tokens"])
    parser.add_argument("--recompute-positions", nargs="*", default=["after_prefix", "sequential"])
    parser.add_argument(
        "--recompute-select", nargs="*", choices=("first", "deviation"), default=["first"]
    )
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768, help="the paged pool, in tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    path = args.gguf or harness.default_gguf()
    pool = {"paged_attn_context_len": args.context}
    cold = harness.load_ours(path, prefix_cache_n=0, **pool)
    backends = {rule: harness.load_ours(path, pic_reuse=rule, **pool) for rule in args.rules}
    for rule, positions, fraction, select in itertools.product(
        args.recompute_rules, args.recompute_positions, args.recompute, args.recompute_select
    ):
        label = recompute_label(rule, fraction, positions, select)
        if label in backends or (positions == "after_prefix" and not fraction and rule in backends):
            continue  # the rule's own row, or 0% under another selection
        backends[label] = harness.load_ours(
            path,
            pic_reuse=rule,
            pic_recompute=fraction,
            pic_positions=positions,
            pic_recompute_select=select,
            **pool,
        )
    rng = random.Random(args.seed)
    lines = []
    for docs in args.docs:
        for words in args.words:
            if not fits(cold, docs, words, args.context):
                print(f"{docs} x {words} words do not fit {args.context} tokens", file=sys.stderr)
                continue
            rows = run_size(backends, cold, docs, words, args, rng)
            lines += summary(docs, words, rows, list(backends))
            print(harness.md_table(HEADER, lines[-len(backends) :]), file=sys.stderr)
    for backend in (cold, *backends.values()):
        backend.close()
    intro = (
        f"{path.name}, {args.questions} questions per size (half need one document, half "
        f"two), greedy {args.tokens} tokens, {args.threads} threads; TTFT p50"
    )
    harness.publish(intro + "\n\n" + harness.md_table(HEADER, lines), args.markdown)


if __name__ == "__main__":
    main()
