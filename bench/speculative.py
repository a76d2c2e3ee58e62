"""Speculative decoding on the default model: acceptance and decode speed against the target.

    python bench/speculative.py [--pairs NAME...] [--gammas 2 4 8 16] [--temperatures 0 0.6]
                                [--threads 2] [--runs 3] [--tokens 128] [--quick]
                                [--markdown FILE]

Pairs (target + draft):

- gguf+self-Q4K: the default GGUF (Gemma 3 270M Q4_K_M) drafted by itself requantized to
  Q4K (MISTRALRS_SPECULATIVE_DRAFT_ISQ alone);
- gguf+self-Q4_0: the same with a Q4_0 draft, lighter still;
- text-f32+gguf: the GGUF dequantized to a float32 text model (as bench/quant.py makes it)
  drafted by the GGUF.

For each pair and sampling (greedy, and temperature 0.6 with fixed seeds) a fresh process
per configuration loads the model, warms up with one short generate, then times --runs
rounds of --tokens tokens after the first from two prompts. Each configuration reports:

- decode tok/s: per round, decode tokens over decode seconds summed across the prompts;
  the median of the rounds; the target alone is the baseline row (gamma "-");
- acceptance: drafts accepted over drafts proposed, all rounds and prompts together;
- load time and peak RSS of the process; for greedy, whether the text equals the target's.

The draft's own cost is measured the same way, greedy, alone: for a self-draft, the text
model with MISTRALRS_ISQ of the draft's type (a GGUF cannot be requantized as a main
model); for the GGUF draft, the GGUF. With c = t_draft / t_target (time per token) and a
the acceptance, a step of gamma k drafts k tokens, verifies k + 1 in one target pass
(costing v target steps; v = 1 is assumed in the prediction, and the table gives the v the
measurement implies) and keeps 1 + k·a tokens on average, so the predicted speedup is
(1 + k·a) / (k·c + v), and with v = 1 speculation pays exactly when a > c.
"""

import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import harness
from harness import STORY_PROMPT

PROMPTS = [
    STORY_PROMPT,
    "The water cycle describes how water moves between the oceans, the air and the land. "
    "It begins when",
]
GAMMAS = [2, 4, 8, 16]
TEMPERATURES = [0.0, 0.6]
SEED = 1234
WARM_UP_TOKENS = 8
QUICK = {"gammas": [2, 4], "runs": 1, "tokens": 32}


@dataclass(frozen=True)
class Config:
    """One measured process: a model, its ISQ, optionally a draft, and the sampling."""

    model: str
    isq: str | None = None
    draft_model: str | None = None
    draft_isq: str | None = None
    gamma: int | None = None
    temperature: float = 0.0


@dataclass(frozen=True)
class Pair:
    name: str
    target: str
    draft_model: str | None
    draft_isq: str | None
    draft_alone: Config  # what measures the draft's cost per token
    draft_label: str

    def baseline(self, temperature: float) -> Config:
        return Config(self.target, temperature=temperature)

    def speculative(self, gamma: int, temperature: float) -> Config:
        return Config(
            self.target,
            draft_model=self.draft_model,
            draft_isq=self.draft_isq,
            gamma=gamma,
            temperature=temperature,
        )


def make_pairs(gguf: Path, text: Path) -> dict[str, Pair]:
    def self_draft(isq: str) -> Pair:
        return Pair(
            f"gguf+self-{isq}",
            str(gguf),
            None,
            isq,
            Config(str(text), isq=isq),
            f"text model with ISQ {isq}",
        )

    return {
        "gguf+self-Q4K": self_draft("Q4K"),
        "gguf+self-Q4_0": self_draft("Q4_0"),
        "text-f32+gguf": Pair(
            "text-f32+gguf", str(text), str(gguf), None, Config(str(gguf)), "the GGUF"
        ),
    }


PAIR_NAMES = ["gguf+self-Q4K", "gguf+self-Q4_0", "text-f32+gguf"]
DEFAULT_PAIRS = ["gguf+self-Q4K", "text-f32+gguf"]


# ---- the child: one configuration in its own process ------------------------------------


def load(config: Config, threads: int):
    import torch

    torch.set_num_threads(threads)
    speculative = {}
    if config.gamma is not None:
        speculative = {
            "speculative_draft_model": config.draft_model,
            "speculative_draft_isq": config.draft_isq,
            "speculative_gamma": config.gamma,
        }
    # Prefix caching off: the repeated rounds must not reuse each other's prompts.
    return harness.load_ours(
        config.model, device="cpu", prefix_cache_n=0, isq=config.isq, **speculative
    )


def decode_seconds(usage) -> float:
    tokens = usage.completion_tokens - 1
    return tokens / usage.decode_tok_s if tokens > 0 and usage.decode_tok_s > 0 else 0.0


def round_rate(usages: list) -> float:
    """Decode tokens over decode seconds, summed across the prompts of one round."""
    seconds = sum(decode_seconds(usage) for usage in usages)
    return sum(usage.completion_tokens - 1 for usage in usages) / seconds if seconds else 0.0


def one_round(backend, config: Config, tokens: int, seed: int) -> list:
    return [
        backend.generate(prompt, max_tokens=tokens + 1, temperature=config.temperature, seed=seed)
        for prompt in PROMPTS
    ]


def digest(results: list) -> str:
    ids = json.dumps([result.token_ids for result in results])
    return hashlib.sha1(ids.encode()).hexdigest()[:12]


def measure(config: Config, threads: int, runs: int, tokens: int) -> dict:
    start = time.perf_counter()
    backend = load(config, threads)
    load_s = time.perf_counter() - start
    backend.generate(STORY_PROMPT, max_tokens=WARM_UP_TOKENS, temperature=config.temperature)
    rounds = [one_round(backend, config, tokens, SEED + run) for run in range(runs)]
    usages = [result.usage for results in rounds for result in results]
    rates = [round_rate([result.usage for result in results]) for results in rounds]
    return {
        "load_s": load_s,
        "decode_tok_s": statistics.median(rates),
        "completion_tokens": sum(u.completion_tokens for u in usages),
        "draft_tokens": sum(getattr(u, "draft_tokens", 0) or 0 for u in usages),
        "accepted_tokens": sum(getattr(u, "accepted_tokens", 0) or 0 for u in usages),
        "digest": digest(rounds[0]),
        "peak_rss_mb": harness.peak_rss_mb(),
    }


# ---- the parent: configurations, each once, in fresh processes --------------------------


class Runner:
    """Runs each configuration once in a child process, remembering the results."""

    def __init__(self, threads: int, runs: int, tokens: int) -> None:
        self.options = ["--threads", str(threads), "--runs", str(runs), "--tokens", str(tokens)]
        self.results: dict[Config, dict] = {}

    def __call__(self, config: Config) -> dict:
        if config not in self.results:
            command = [sys.executable, __file__, "--child", json.dumps(asdict(config))]
            self.results[config] = harness.run_json_child(command + self.options)
            print(json.dumps(asdict(config) | self.results[config]), file=sys.stderr)
        return self.results[config]


def acceptance(result: dict) -> float | None:
    drafted = result.get("draft_tokens") or 0
    return result["accepted_tokens"] / drafted if drafted else None


def cost_ratio(target: dict, draft: dict) -> float | None:
    """c = t_draft / t_target, from the two decode rates."""
    if "error" in target or "error" in draft or not draft["decode_tok_s"]:
        return None
    return target["decode_tok_s"] / draft["decode_tok_s"]


def predicted_speedup(gamma: int, accept: float, c: float, v: float = 1.0) -> float:
    return (1 + gamma * accept) / (gamma * c + v)


def implied_v(gamma: int, accept: float, c: float, speedup: float) -> float:
    """The verify cost (in target steps) that makes the prediction match the measurement."""
    return (1 + gamma * accept) / speedup - gamma * c


def sampling_name(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"T={temperature:g}"


def pair_rows(pair: Pair, gammas: list[int], temperatures: list[float], run: Runner) -> dict:
    """Everything measured for one pair, as rows for the table and a summary. The cost ratio
    compares the draft and the target alone, both greedy."""
    draft, target = run(pair.draft_alone), run(pair.baseline(0.0))
    c = cost_ratio(target, draft)
    rows = []
    for temperature in temperatures:
        base = run(pair.baseline(temperature))
        rows.append(row_of(pair.name, None, temperature, base, base, c))
        for gamma in gammas:
            spec = run(pair.speculative(gamma, temperature))
            rows.append(row_of(pair.name, gamma, temperature, spec, base, c))
    return {"pair": pair, "rows": rows, "draft": draft, "target": target, "c": c}


def row_of(
    pair: str, gamma: int | None, temperature: float, result: dict, base: dict, c: float | None
) -> dict:
    row = {"pair": pair, "gamma": gamma, "temperature": temperature, "result": result}
    if "error" in result or "error" in base or not base["decode_tok_s"]:
        return row
    row["speedup"] = result["decode_tok_s"] / base["decode_tok_s"]
    if gamma is None:
        return row
    if temperature == 0:
        row["same_text"] = result["digest"] == base["digest"]
    accept = acceptance(result)
    if accept is not None and c is not None:
        row["tokens_per_step"] = 1 + gamma * accept
        row["predicted"] = predicted_speedup(gamma, accept, c)
        row["implied_v"] = implied_v(gamma, accept, c, row["speedup"])
    return row


# ---- the report -----------------------------------------------------------------------------

HEADER = ["pair", "gamma", "sampling", "decode tok/s", "vs target alone", "acceptance"]
HEADER += ["tokens/step", "predicted (v = 1)", "implied v", "same text", "peak RSS", "load"]


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def table_cells(row: dict) -> list[str]:
    result = row["result"]
    gamma = "-" if row["gamma"] is None else str(row["gamma"])
    head = [row["pair"], gamma, sampling_name(row["temperature"])]
    if "error" in result:
        return [*head, f"not run: {result['error']}"]
    same = {None: "", True: "yes", False: "no"}[row.get("same_text")]
    accept = acceptance(result) if row["gamma"] is not None else None
    cells = [
        fmt(result["decode_tok_s"], ".1f"),
        fmt(row.get("speedup"), ".2f", "×"),
        fmt(None if accept is None else 100 * accept, ".0f", "%"),
        fmt(row.get("tokens_per_step"), ".2f"),
        fmt(row.get("predicted"), ".2f", "×"),
        fmt(row.get("implied_v"), ".2f"),
        same,
        fmt(result["peak_rss_mb"], ",.0f", " MB"),
        fmt(result["load_s"], ".1f", " s"),
    ]
    return head + cells


def best_row(rows: list[dict]) -> dict | None:
    measured = [r for r in rows if r["gamma"] is not None and "speedup" in r]
    return max(measured, key=lambda r: r["speedup"], default=None)


def arithmetic_line(summary: dict) -> str:
    pair, target, draft, c = (summary[key] for key in ("pair", "target", "draft", "c"))
    if c is None:
        return f"- {pair.name}: the draft's or the target's own speed was not measured."
    best = best_row(summary["rows"])
    line = (
        f"- {pair.name}: target alone {target['decode_tok_s']:.1f} tok/s, draft alone "
        f"({pair.draft_label}) {draft['decode_tok_s']:.1f} tok/s, so c = t_draft/t_target "
        f"= {c:.2f}. A step of gamma k costs k·{c:.2f} + v target steps and yields 1 + k·a "
        f"tokens; with v ≈ 1 it pays only when the acceptance a exceeds {c:.2f}."
    )
    if best is None:
        return line
    accept = acceptance(best["result"]) or 0.0
    return line + (
        f" Best measured: {best['speedup']:.2f}× at gamma {best['gamma']}, "
        f"{sampling_name(best['temperature'])} (a = {accept:.2f}, implied v = "
        f"{best.get('implied_v', float('nan')):.2f})."
    )


def mean_speedup_by_gamma(rows: list[dict]) -> dict[int, float]:
    by_gamma: dict[int, list[float]] = {}
    for row in rows:
        if row["gamma"] is not None and "speedup" in row:
            by_gamma.setdefault(row["gamma"], []).append(row["speedup"])
    return {gamma: statistics.fmean(values) for gamma, values in by_gamma.items()}


def best_gamma_line(summary: dict) -> str:
    """The gamma with the best mean speedup over the samplings, for one pair."""
    means = mean_speedup_by_gamma(summary["rows"])
    if not means:
        return f"- {summary['pair'].name}: no speculative configuration was measured."
    gamma = max(means, key=means.__getitem__)
    verdict = "pays" if means[gamma] > 1 else "does not pay on this CPU"
    return (
        f"- {summary['pair'].name}: best gamma {gamma}, mean speedup {means[gamma]:.2f}× "
        f"over the samplings; speculation {verdict}."
    )


def default_line(summaries: list[dict]) -> str:
    """The gamma with the best mean speedup over every pair and sampling measured."""
    means = mean_speedup_by_gamma([row for summary in summaries for row in summary["rows"]])
    if not means:
        return "Chosen default gamma: none measured."
    gamma = max(means, key=means.__getitem__)
    verdict = "speculation pays" if means[gamma] > 1 else "speculation does not pay here"
    return (
        f"Chosen default gamma: {gamma} (mean speedup {means[gamma]:.2f}× over all pairs "
        f"and samplings; {verdict})."
    )


def report(summaries: list[dict], threads: int, runs: int, tokens: int) -> str:
    rows = [table_cells(row) for summary in summaries for row in summary["rows"]]
    lines = [harness.md_table(HEADER, rows)]
    lines.append(
        f"\n{threads} threads; {tokens} decode tokens from each of {len(PROMPTS)} prompts, "
        f"median of {runs} round{'s' if runs != 1 else ''}; T>0 with fixed seeds. "
        "Acceptance: drafts accepted over "
        "drafts proposed. tokens/step: 1 + gamma·acceptance (each step drafting gamma). "
        "Predicted: (1 + k·a)/(k·c + v) with v = 1; implied v: the verify cost that matches "
        "the measurement. Same text: greedy output equal to the target alone's.\n"
    )
    lines += [arithmetic_line(summary) for summary in summaries]
    lines.append("")
    lines += [best_gamma_line(summary) for summary in summaries]
    lines.append("\n" + default_line(summaries))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = harness.arguments(__doc__, runs=True)
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=DEFAULT_PAIRS,
        choices=PAIR_NAMES,
        help="target+draft pairs (default: %(default)s)",
    )
    parser.add_argument("--gammas", nargs="+", type=int, default=GAMMAS, help="draft lengths")
    parser.add_argument(
        "--temperatures", nargs="+", type=float, default=TEMPERATURES, help="0 is greedy"
    )
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens per prompt")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: the first pair only, gammas 2 and 4, 1 run, 32 tokens",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.pairs = args.pairs[:1]
        vars(args).update(QUICK)
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        config = Config(**json.loads(args.child))
        print(json.dumps(measure(config, args.threads, args.runs, args.tokens)))
        return
    gguf = harness.default_gguf()
    pairs = make_pairs(gguf, harness.text_model_dir(gguf))
    run = Runner(args.threads, args.runs, args.tokens)
    summaries = [pair_rows(pairs[name], args.gammas, args.temperatures, run) for name in args.pairs]
    harness.publish(report(summaries, args.threads, args.runs, args.tokens), args.markdown)


if __name__ == "__main__":
    main()
