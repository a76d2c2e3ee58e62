"""Shared test helpers: tiny models loaded both ways, and full-sequence logits."""

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from tiny_models import TinyModel, build_hf_model, build_trained_model, write_gguf

from spnl_backend import Backend, BackendSettings, load_backend
from spnl_backend.engine.engine import Engine
from spnl_backend.engine.kv_cache import ContiguousStep, SequenceKV, StepSlice
from spnl_backend.quant.linear import QuantLinear

CPU = BackendSettings(device="cpu")
# For tests that count on one token a step (`scripted_logits`, per-step recorders): the
# default speculation (n-gram lookup) may verify several.
NO_SPECULATION = BackendSettings(device="cpu", speculative_method="none")
PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 3)
# Prompts of several lengths that share prefixes: batches that exercise the prefix cache.
SHARED_PREFIX_PROMPTS = [
    PROMPT,
    "The capital of France is",
    PROMPT + " And again the fox.",
    "def add(a, b):",
    "Numbers: 1 2 3",
]


def model_logits(backend: Backend, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids``, through our model and a fresh cache."""
    model = backend.model
    config = model.config
    # (the loader's compute dtype: a model may hold no float weight at all, OLMo's in Q8_0)
    dtype = getattr(torch, backend.platform.resolve_dtype(config.dtype))
    kv = SequenceKV(config.kv_shapes, dtype, torch.device("cpu"), planes=config.kv_planes)
    kv.reserve(len(ids), used=0)
    step = ContiguousStep([StepSlice(kv, 0, len(ids))])
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), step)
        return model.compute_logits(hidden)


def dequantize_in_place(backend: Backend) -> None:
    """Every quantized projection replaced by a float one holding its blocks' values (before
    the backend's first step: its layers' native calls are made then, and kept)."""
    for name, module in list(backend.model.named_modules()):
        if isinstance(module, QuantLinear):
            parent, _, attr = name.rpartition(".")
            dense = torch.nn.Linear(module.in_features, module.out_features, bias=False)
            dense.weight = torch.nn.Parameter(module.weight_q.dequantize().float())
            dense.bias = module.bias
            setattr(backend.model.get_submodule(parent), attr, dense)


class TinyModels:
    """Builds each architecture's tiny model once per test session."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @cache  # noqa: B019 - one instance per session
    def hf(self, arch: str) -> TinyModel:
        return build_hf_model(arch, self.root / arch / "hf")

    @cache  # noqa: B019
    def backend(self, arch: str) -> Backend:
        return load_backend(str(self.hf(arch).path), settings=CPU)

    @cache  # noqa: B019
    def trained(self) -> TinyModel:
        """A Llama wide enough for every ISQ type, trained to be confident."""
        return build_trained_model(self.root / "trained" / "hf")

    @cache  # noqa: B019
    def gguf(self, arch: str, qtype: GGMLQuantizationType) -> Path:
        """The tiny model's GGUF twin: by llama.cpp's own converter for the families it
        converts here (`tiny_models.CONVERTED`), else as `write_gguf` writes it."""
        path = self.root / arch / f"model-{qtype.name}.gguf"
        return write_gguf(self.hf(arch), path, qtype)


def engine_logits(backend: Backend, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids`` through the backend's own KV cache (paged or not)."""
    from spnl_backend.engine.prompt_logits import prompt_logits

    engine_internals(backend)  # open
    return backend._loop.call(lambda engine: prompt_logits(engine, ids, torch.device("cpu")))


def greedy_with_logits(backend: Backend, tokens: int, **prompt):
    """Greedy tokens, the first token's logits and the usage of one request (``prompt``:
    `Backend.generate`'s prompt keywords)."""
    model = backend.model
    seen = []
    original = type(model).compute_logits

    def capture(hidden):
        logits = original(model, hidden)
        seen.append(logits.clone())
        return logits

    model.compute_logits = capture
    try:
        result = backend.generate(**prompt, max_tokens=tokens, temperature=0)
    finally:
        del model.compute_logits
    return result.token_ids, seen[0][-1], result.usage


def engine_internals(backend: Backend) -> Engine:
    """The backend's private engine: the one way tests reach it. Only for injecting faults
    (breaking a cache, swapping its kernels or store factory) and for white-box checks that
    no public API should offer (block tables, codec state, the draft's cache, stepping the
    engine by hand, scoring through its cache). Everything else reads `Backend.stats()`,
    `Backend.cache_info()` and `Backend.model`."""
    loop = backend._loop
    assert loop is not None, "the backend is closed"
    return loop.engine


@contextlib.contextmanager
def loop_held(backend: Backend) -> Iterator[None]:
    """Hold the backend's engine loop between two steps: what is submitted meanwhile
    reaches the engine together when the block ends (so it shares its first step), and
    the engine's state may be read or changed (fault injection) without a step running."""
    loop = backend._loop
    assert loop is not None, "the backend is closed"
    entered, release = threading.Event(), threading.Event()
    loop._commands.append(lambda: (entered.set(), release.wait()))
    loop.wake.set()
    entered.wait()
    try:
        yield
    finally:
        release.set()


def run_together(backend: Backend, *calls: Callable[[], object]) -> list[object]:
    """Run each call in a thread of its own, their requests submitted while the loop is
    held so that all of them share the first step: each call's result or exception."""
    results: list[object] = [None] * len(calls)

    def run(index: int, call: Callable[[], object]) -> None:
        try:
            results[index] = call()
        except Exception as exc:  # handed to the test, which checks it
            results[index] = exc

    loop = backend._loop
    threads = [threading.Thread(target=run, args=item) for item in enumerate(calls)]
    with loop_held(backend):
        queued = len(loop._commands)
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(loop._commands) < queued + len(calls) and time.monotonic() < deadline:
            time.sleep(0.001)
    for thread in threads:
        thread.join()
    return results


def plus_chat_usage(backend: Backend, docs: list[str], order: list[int], question: str):
    """The usage of a chat as spnl's RAG sends it: a system prompt, the documents in
    ``order`` as plus messages, a question (one greedy token)."""
    from spnl_backend.pic.pieces import PLUS_MARKER

    messages = [{"role": "system", "content": "Answer from the documents."}]
    messages += [{"role": "user", "content": PLUS_MARKER + docs[i]} for i in order]
    messages.append({"role": "user", "content": question})
    return backend.chat(messages, max_tokens=1, temperature=0).usage


def scripted_logits(backend: Backend, monkeypatch) -> list[int]:
    """A script of tokens the model's logits are biased toward, one a step (one sequence
    at a time), while the list has any: how a test makes a tiny model write a whole output,
    markers included, where a constraint would hold only the answer. A constraint's or the
    reasoning's mask still decides wherever it allows fewer tokens. One token a step: the
    backend runs without speculation (`NO_SPECULATION`)."""
    engine = engine_internals(backend)
    assert engine.speculation is None, "scripted logits need a backend without speculation"
    model = engine.runner.model
    compute = model.compute_logits
    script: list[int] = []

    def biased(hidden):
        logits = compute(hidden)
        if script:
            logits = logits.clone()
            logits[:, script.pop(0)] += 1000.0
        return logits

    monkeypatch.setattr(model, "compute_logits", biased)
    return script
