"""The CPU's threads: one pool for the native kernels (pool.c), sized from what the process
may use; results that never depend on how many threads compute them; the engine's own
torch operations on its thread alone."""

import ctypes
import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from spnl_backend import BackendSettings, load_backend
from spnl_backend.errors import SettingsError
from spnl_backend.kernels.scoring import Scoring
from spnl_backend.kernels.threads import torch_on_this_thread_alone
from spnl_backend.quant.linear import QuantizedWeight
from spnl_backend.settings import decide_platform
from spnl_backend.settings.platform import PlatformProbe

THREADS = (1, 2, 3, 5)


@pytest.fixture(scope="module")
def kernels(native_kernels):
    return native_kernels


def _on(kernels, threads: int):
    return dataclasses.replace(kernels, threads=threads)


def _weights(qtype: Q, rows: int, cols: int, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    return QuantizedWeight.from_float(torch.randn(rows, cols, generator=gen), qtype)


@pytest.mark.parametrize("exact", [False, True], ids=["int8", "float"])
@pytest.mark.parametrize("rows", [1, 7, 70])
def test_products_are_the_same_bits_on_any_threads(kernels, exact, rows):
    weights = [_weights(Q.Q4_K, 200, 512, 0), _weights(Q.Q8_0, 37, 512, 1)]
    args = [(w.qtype.value, w.data, w.shape[0]) for w in weights]
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(2))
    results = [dataclasses.replace(_on(kernels, t), exact=exact).products(args)(x) for t in THREADS]
    assert all(torch.equal(result, results[0]) for result in results)
    groups = [(0, 0, rows, 0), (rows // 2, 0, rows - rows // 2, 200)]
    grouped = [_on(kernels, t).products(args).groups(x, groups, rows) for t in THREADS]
    assert all(torch.equal(result, grouped[0]) for result in grouped)


def test_dequantized_matrices_are_the_same_on_any_threads(kernels):
    weight = _weights(Q.Q6_K, 300, 256, 3)
    results = [_on(kernels, t).dequantize(weight.qtype.value, weight.data, 300, 256)
               for t in THREADS]  # fmt: skip
    assert all(torch.equal(result, results[0]) for result in results)


def test_coded_decode_sums_in_the_same_order_on_any_threads(kernels):
    """The compressed cache's values are summed in fixed chunks of keys, whatever the
    threads (before, each thread summed its own share)."""
    dim, keys, k_bits, v_bits = 32, 300, 4, 3
    gen = torch.Generator().manual_seed(4)
    k_bytes, v_bytes = dim * k_bits // 8 + 2, dim * v_bits // 8 + 2
    k_pool = torch.randint(0, 255, (keys, 1, k_bytes), dtype=torch.uint8, generator=gen)
    v_pool = torch.randint(0, 255, (keys, 1, v_bytes), dtype=torch.uint8, generator=gen)
    for pool, bits in ((k_pool, k_bits), (v_pool, v_bits)):  # finite float16 gains
        pool[:, :, dim * bits // 8 : dim * bits // 8 + 2] = torch.tensor([0, 60], dtype=torch.uint8)
    args = [
        torch.randn(1, 2, dim, generator=gen),
        torch.randn(1, 2, dim, generator=gen),
        (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, dim)),
        k_pool,
        v_pool,
        (torch.randn(1 << k_bits, generator=gen), k_bits, 0),
        (torch.randn(1 << v_bits, generator=gen), v_bits),
        torch.arange(keys)[None],
        torch.tensor([keys]),
        Scoring(0.25),
    ]
    results = [_on(kernels, t).coded_decode(*args) for t in THREADS]
    assert torch.isfinite(results[0]).all()
    assert all(torch.equal(result, results[0]) for result in results)


def test_the_pool_serves_several_callers_at_once(kernels):
    """Two threads calling at once: one runs on the pool, the other inline; both exact."""
    weights = [_weights(Q.Q8_0, 512, 512, 5)]
    args = [(w.qtype.value, w.data, w.shape[0]) for w in weights]
    xs = [torch.randn(9, 512, generator=torch.Generator().manual_seed(i)) for i in range(16)]
    alone = [_on(kernels, 1).products(args)(x) for x in xs]
    on_two = _on(kernels, 2).products(args)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(on_two, xs))
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


@pytest.mark.parametrize(("tasks", "threads"), [(1, 4), (7, 3), (1000, 2), (100_000, 5)])
def test_every_task_runs_once_however_many_jobs(kernels, tasks, threads):
    counts = torch.zeros(tasks, dtype=torch.int64)
    assert kernels.library.spnl_pool_check(tasks, threads, 200, counts.data_ptr()) == 0
    assert bool((counts == 200).all())


def test_jobs_from_several_threads_at_once_each_run_every_task_once(kernels):
    counts = [torch.zeros(5000, dtype=torch.int64) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(
            lambda c: kernels.library.spnl_pool_check(5000, 3, 100, c.data_ptr()), counts
        ))  # fmt: skip
    assert codes == [0, 0, 0, 0]
    assert all(bool((c == 100).all()) for c in counts)


def test_a_forked_child_starts_a_pool_of_its_own(kernels):
    weights = [_weights(Q.Q8_0, 64, 256, 6)]
    args = [(w.qtype.value, w.data, w.shape[0]) for w in weights]
    x = torch.randn(3, 256)
    parent = _on(kernels, 2).products(args)(x)  # the parent's workers exist
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its pool has no workers until it makes them
        try:
            child = _on(kernels, 2).products(args)(x)
            os.write(writer, b"1" if torch.equal(child, parent) else b"0")
        finally:
            os._exit(0)
    os.close(writer)
    answer = os.read(reader, 1)
    os.waitpid(pid, 0)
    assert answer == b"1"


# ---- the size of the pool ----------------------------------------------------------------


def _probe(**facts) -> PlatformProbe:
    return PlatformProbe(os="linux", torch_version="2.13.0", **facts)


@pytest.mark.parametrize(
    ("settings", "facts", "threads", "why"),
    [
        ({}, {"cpus_allowed": 8}, 8, "8 CPUs this process may run on"),
        ({}, {"cpus_allowed": 8, "cpu_quota": 2.5}, 3, "cgroup's CPU quota of 2.5"),
        ({}, {"cpus_allowed": 2, "cpu_quota": 4.0}, 2, "2 CPUs"),
        ({}, {"cpus_allowed": 1}, 1, "1 CPU this process"),
        ({}, {"cpus_allowed": 8, "omp_num_threads": "3"}, 3, "OMP_NUM_THREADS=3"),
        ({}, {"cpus_allowed": 8, "omp_num_threads": "4,2"}, 4, "OMP_NUM_THREADS=4,2"),
        ({"num_threads": 5}, {"omp_num_threads": "3"}, 5, "MISTRALRS_NUM_THREADS=5"),
        ({}, {"cpus_allowed": 1000}, 256, "1000 CPUs"),
    ],
)
def test_the_pool_is_sized_from_what_the_process_may_use(settings, facts, threads, why):
    decisions = decide_platform(BackendSettings(device="cpu", **settings), _probe(**facts))
    assert decisions.threads == threads
    assert why in decisions.threads_reason


@pytest.mark.parametrize("value", ["zero", "0", "-2", "300", " "])
def test_a_bad_omp_num_threads_is_an_error_naming_it(value):
    with pytest.raises(SettingsError, match="OMP_NUM_THREADS"):
        decide_platform(BackendSettings(device="cpu"), _probe(omp_num_threads=value))


def _mkl_max_threads():
    """MKL's thread count for the calling thread, where torch carries MKL; else None."""
    library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    getter = getattr(library, "MKL_Get_Max_Threads", None)
    return None if getter is None else getter()


def test_the_engine_threads_torch_operations_run_on_it_alone():
    seen = {}

    def engine_thread() -> None:
        seen["set"] = torch_on_this_thread_alone()
        seen["there"] = torch.get_num_threads()
        seen["mkl"] = _mkl_max_threads()

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # as a host may, before loading: MKL's count is the process's
    try:
        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        host_mkl = _mkl_max_threads()
    finally:
        torch.set_num_threads(before)
    assert seen["set"] is True
    assert seen["there"] == 1
    assert seen["mkl"] in (1, None)  # MKL's vector math (torch.cos, exp) on it alone too
    assert host_mkl in (2, None)  # the host's other threads keep theirs


# ---- whole models ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "isq"), [("llama", "Q8_0"), ("gemma3", "Q4K"), ("qwen2", None), ("phi3", "Q6K")]
)
def test_greedy_tokens_and_logits_are_the_same_at_any_thread_count(tiny, arch, isq):
    """Float weights too: their products run on the engine thread's torch alone."""
    from helpers import engine_logits

    path = str(tiny.hf(arch).path)
    prompts = ["The capital of France is", "def add(a, b):", "Numbers: 0 1 2"]
    runs = []
    for threads in (1, 2, 3):
        settings = BackendSettings(device="cpu", isq=isq, num_threads=threads)
        with load_backend(path, settings=settings) as backend:
            assert backend.platform.threads == threads
            tokens = [r.token_ids for r in backend.generate(prompts, max_tokens=12, temperature=0)]
            ids = backend.tokenizer.encode(" ".join(prompts) * 3)
            runs.append((tokens, engine_logits(backend, ids)))
    for tokens, logits in runs[1:]:
        assert tokens == runs[0][0]
        assert torch.equal(logits, runs[0][1])
