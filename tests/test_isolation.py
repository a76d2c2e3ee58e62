"""A failing request fails alone: its caller gets the error, its cache is freed, and the
requests beside it finish with exactly the tokens they would have had without it."""

import gc
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers import CPU, PROMPT, engine_internals, loop_held, run_together

from spnl_backend import BackendSettings, EngineError, RequestAbortedError, load_backend
from spnl_backend.engine import sampler
from spnl_backend.engine.detokenizer import IncrementalDetokenizer
from spnl_backend.models.transformer import CausalLM

PROMPTS = ["The capital of France is", "Once upon a time there was", "def add(a, b):"]
POISON_SEED = 666  # the sampler test double fails rows with this seed


def _greedy(backend, prompt, **kw):
    return backend.generate(prompt, temperature=0, **kw)


@pytest.fixture(scope="module", params=[True, False], ids=["paged", "non-paged"])
def backend(tiny, request):
    """Without speculation: the fault doubles below stand in for the plain step's sampler
    (speculation's verification has its own test, `test_a_request_whose_verification_...`)."""
    settings = BackendSettings(device="cpu", paged_attn=request.param, speculative_method="none")
    return load_backend(str(tiny.hf("qwen3").path), settings=settings)


@pytest.fixture(scope="module")
def solo(backend):
    return {p: _greedy(backend, p, max_tokens=24).token_ids for p in PROMPTS}


def _assert_clean(backend):
    stats = backend.stats()
    assert (stats.running, stats.waiting, stats.cache_holders) == (0, 0, 0)
    if stats.pool is not None:
        assert stats.pool.in_use == 0


def _stream_with(backend, failing_call, prompt=PROMPTS[0]):
    """Run a greedy stream and ``failing_call`` together (they share steps): returns the
    stream's text and the call's error."""
    text, error = run_together(
        backend, lambda: "".join(backend.stream(prompt, max_tokens=24, temperature=0)), failing_call
    )
    assert isinstance(error, Exception), f"the call did not fail: {error!r}"
    return text, error


def test_a_request_whose_sampling_fails_fails_alone(backend, solo, monkeypatch):
    real = sampler._sample_row

    def fails_for_the_poison_seed(logits, p, generator):
        if p.seed == POISON_SEED:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, p, generator)

    monkeypatch.setattr(sampler, "_sample_row", fails_for_the_poison_seed)
    text, error = _stream_with(
        backend,
        lambda: backend.generate(PROMPTS[1], max_tokens=8, temperature=1.0, seed=POISON_SEED),
    )
    assert isinstance(error, EngineError)
    assert "choosing the next token failed" in str(error)
    assert text == backend.tokenizer.decode(solo[PROMPTS[0]])
    _assert_clean(backend)


def test_a_request_whose_verification_fails_fails_alone(tiny, monkeypatch):
    """Under n-gram speculation (the default) a row whose verification raises fails its
    request alone; the greedy stream beside it keeps its tokens."""
    from spnl_backend.engine import speculative

    settings = BackendSettings(device="cpu", speculative_method="ngram")
    spec = load_backend(str(tiny.hf("qwen3").path), settings=settings)
    want = _greedy(spec, PROMPTS[0], max_tokens=24).token_ids
    real = speculative.verify

    def fails_for_the_poison_seed(logits, drafts, probs, p, generator):
        if p.seed == POISON_SEED:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, drafts, probs, p, generator)

    monkeypatch.setattr(speculative, "verify", fails_for_the_poison_seed)
    text, error = _stream_with(
        spec, lambda: spec.generate(PROMPTS[1], max_tokens=8, temperature=1.0, seed=POISON_SEED)
    )
    assert isinstance(error, EngineError)
    assert "choosing the next token failed" in str(error)
    assert text == spec.tokenizer.decode(want)
    _assert_clean(spec)


def test_a_request_whose_stop_handling_fails_fails_alone(backend, solo, monkeypatch):
    real = IncrementalDetokenizer._cut_at_stop

    def fails_for_a_marker(self, search_from):
        if "@@" in self.stop:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(self, search_from)

    monkeypatch.setattr(IncrementalDetokenizer, "_cut_at_stop", fails_for_a_marker)
    text, error = _stream_with(
        backend, lambda: _greedy(backend, PROMPTS[2], max_tokens=8, stop="@@")
    )
    assert isinstance(error, EngineError)
    assert text == backend.tokenizer.decode(solo[PROMPTS[0]])
    _assert_clean(backend)


def test_a_failing_request_in_a_list_fails_the_call_and_frees_every_prompt(backend, monkeypatch):
    monkeypatch.setattr(sampler, "_checked_greedy", _raise_once(sampler._checked_greedy))
    with pytest.raises(EngineError):
        _greedy(backend, PROMPTS, max_tokens=8)
    _assert_clean(backend)


def _raise_once(function):
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a fault")
        return function(*args, **kwargs)

    return wrapper


def _fail_second_forward(monkeypatch, error):
    real = CausalLM.forward
    calls = []

    def fails_on_the_second_step(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(self, *args)

    monkeypatch.setattr(CausalLM, "forward", fails_on_the_second_step)


def _stream_and_call(backend):
    return run_together(
        backend,
        lambda: list(backend.stream(PROMPTS[0], max_tokens=24, temperature=0)),
        lambda: _greedy(backend, PROMPTS[1], max_tokens=8),
    )


def test_a_failing_step_fails_its_requests_and_the_next_call_works(backend, solo, monkeypatch):
    _fail_second_forward(monkeypatch, RuntimeError("out of memory"))
    for outcome in _stream_and_call(backend):
        assert isinstance(outcome, EngineError)
        assert "the engine step failed: RuntimeError: out of memory" in str(outcome)
    _assert_clean(backend)
    assert [_greedy(backend, p, max_tokens=24).token_ids for p in PROMPTS] == list(solo.values())


def test_an_interrupted_step_fails_its_requests_and_leaves_the_backend_usable(
    backend, solo, monkeypatch
):
    """An interruption inside a step (on the engine thread) fails the step's requests,
    not the loop: the next call works."""
    _fail_second_forward(monkeypatch, KeyboardInterrupt())
    for outcome in _stream_and_call(backend):
        assert isinstance(outcome, EngineError)
        assert "KeyboardInterrupt" in str(outcome)
    _assert_clean(backend)
    assert _greedy(backend, PROMPTS[2], max_tokens=24).token_ids == solo[PROMPTS[2]]


def test_many_threads_with_bad_requests_among_them(backend, solo):
    results, errors = {}, []
    bad = [
        {"temperature": 1e-45, "seed": 1},
        {"top_p": 1e-300, "temperature": 1.0, "seed": 2},
        {"seed": 2**70},
        {"stop": 5},
    ]

    def good(prompt):
        results[prompt] = _greedy(backend, prompt, max_tokens=24).token_ids

    def odd(kw):
        try:
            backend.generate(PROMPTS[1], max_tokens=8, **kw)
        except Exception as exc:  # the test collects what each odd request raised
            errors.append(type(exc).__name__)

    threads = [threading.Thread(target=good, args=(p,)) for p in PROMPTS]
    threads += [threading.Thread(target=odd, args=(kw,)) for kw in bad]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == solo
    assert sorted(errors) == ["RequestError", "RequestError"]
    _assert_clean(backend)


# ---- streams ---------------------------------------------------------------------------


def test_a_closed_stream_is_aborted_and_frees_its_cache(backend):
    stream = backend.stream(PROMPTS[0], max_tokens=50, temperature=0)
    next(stream)
    assert backend.stats().running == 1
    stream.close()
    _assert_clean(backend)


def test_a_garbage_collected_stream_is_aborted(backend):
    stream = backend.stream(PROMPTS[0], max_tokens=50, temperature=0)
    next(stream)
    del stream
    gc.collect()
    _assert_clean(backend)


def test_leaving_the_loop_aborts_the_stream(backend):
    for _ in backend.stream(PROMPTS[0], max_tokens=50, temperature=0):
        break
    _assert_clean(backend)


def test_an_unread_stream_pauses_then_resumes_where_it_was(backend, solo, monkeypatch):
    monkeypatch.setattr("spnl_backend.engine.loop.STREAM_BUFFER", 4)
    stream = backend.stream(PROMPTS[0], max_tokens=24, temperature=0)
    first = next(stream)
    _greedy(backend, PROMPTS[1], max_tokens=24)  # steps the engine while the stream waits
    assert backend.stats().paused == 1
    assert first + "".join(stream) == backend.tokenizer.decode(solo[PROMPTS[0]])
    _assert_clean(backend)


def test_a_stream_left_unread_too_long_is_aborted(backend, monkeypatch):
    monkeypatch.setattr("spnl_backend.engine.loop.STREAM_BUFFER", 4)
    monkeypatch.setattr("spnl_backend.engine.loop.STREAM_IDLE_TIMEOUT_S", 0.0)
    stream = backend.stream(PROMPTS[0], max_tokens=24, temperature=0)
    next(stream)
    _greedy(backend, PROMPTS[1], max_tokens=24)
    with pytest.raises(RequestAbortedError, match="not read"):
        list(stream)
    _assert_clean(backend)


def test_a_paused_stream_gives_up_its_cache_first(tiny, monkeypatch):
    monkeypatch.setattr("spnl_backend.engine.loop.STREAM_BUFFER", 2)
    settings = BackendSettings(device="cpu", paged_attn=True, paged_attn_context_len=64)
    backend = load_backend(str(tiny.hf("qwen3").path), settings=settings)
    alone = [_greedy(backend, p, max_tokens=40).token_ids for p in PROMPTS[:2]]
    stream = backend.stream(PROMPTS[0], max_tokens=40, temperature=0)
    first = next(stream)
    other = _greedy(backend, PROMPTS[1], max_tokens=40)  # needs the paused stream's blocks
    assert backend.stats().preemptions >= 1
    assert other.token_ids == alone[1]
    assert first + "".join(stream) == backend.tokenizer.decode(alone[0])


# ---- closing ---------------------------------------------------------------------------


def test_close_aborts_running_requests_and_refuses_new_ones(tiny):
    backend = load_backend(str(tiny.hf("qwen3").path), settings=CPU)
    stream = backend.stream(PROMPTS[0], max_tokens=50, temperature=0)
    next(stream)
    backend.close()
    with pytest.raises(RequestAbortedError, match="closed"):
        list(stream)
    with pytest.raises(RequestAbortedError, match="closed"):
        backend.generate(PROMPTS[0])
    backend.close()  # twice is fine
    assert backend.closed


def test_a_backend_is_a_context_manager(tiny):
    with load_backend(str(tiny.hf("qwen3").path), settings=CPU) as backend:
        assert _greedy(backend, PROMPTS[0], max_tokens=4).usage.completion_tokens == 4
    assert backend.closed


# ---- state the native kernels must never see --------------------------------------------


@pytest.fixture(params=["none", "tq4"], ids=["plain-pool", "coded-pool"])
def quantized(tiny, request):
    from gguf import GGMLQuantizationType

    path = tiny.gguf("llama", GGMLQuantizationType.Q8_0)
    settings = BackendSettings(device="cpu", paged_attn=True, kv_cache_compression=request.param)
    return load_backend(str(path), settings=settings)


def test_a_block_table_pointing_outside_the_pool_fails_the_step_not_the_process(
    quantized, monkeypatch
):
    monkeypatch.setattr("spnl_backend.engine.loop.STREAM_BUFFER", 2)  # it waits for us
    stream = quantized.stream(PROMPT, max_tokens=24, temperature=0)
    next(stream)
    with loop_held(quantized):
        manager = engine_internals(quantized).cache  # the one way to break its state
        (table,) = manager.tables.values()
        assert len(table.block_ids) > 1  # the first block is read, not written, from now on
        table.block_ids[0] = manager.blocks.num_blocks + 1000
    with pytest.raises(EngineError, match="outside the pool"):
        list(stream)
    # Releasing that table cannot work either: the backend says so from now on.
    with pytest.raises(EngineError, match=r"the engine is unusable.*outside the pool"):
        _greedy(quantized, PROMPTS[1], max_tokens=12)


def test_the_reported_crash_cannot_happen_again(tiny):
    """The reported reproduction, in a child process so that a crash fails this test: two
    requests on a quantized model share steps while one of them has a vanishing
    temperature or top_p, or its sampling fails outright."""
    from gguf import GGMLQuantizationType

    path = tiny.gguf("llama", GGMLQuantizationType.Q8_0)
    script = textwrap.dedent(
        f"""
        import faulthandler, signal, threading
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it hangs, if it does
        from spnl_backend import BackendSettings, EngineError, load_backend
        from spnl_backend.engine import sampler
        backend = load_backend({str(path)!r}, settings=BackendSettings(device="cpu"))
        alone = backend.generate("The capital", max_tokens=40, temperature=0).token_ids
        real = sampler._sample_row
        def fails(logits, p, generator):
            if p.seed == 13:
                raise RuntimeError("probability tensor contains either inf, nan or < 0")
            return real(logits, p, generator)
        sampler._sample_row = fails
        odd = [dict(temperature=1e-45), dict(top_p=1e-300, temperature=1.0), dict(seed=13)]
        for kw in odd * 3:
            stream = backend.stream("The capital", max_tokens=40, temperature=0)
            text = next(stream)
            try:
                backend.generate("Once upon a time", max_tokens=8, **kw)
            except EngineError:
                pass
            text += "".join(stream)
            assert text == backend.tokenizer.decode(alone), kw
        print("survived")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "survived" in done.stdout


@pytest.mark.parametrize("delay", [2.0, 3.5])
def test_ctrl_c_among_concurrent_steps_leaves_a_consistent_backend(tiny, delay, foreground):
    """A real SIGINT while four threads share steps on a quantized model: the main thread
    gets KeyboardInterrupt, the others EngineError or their tokens, and the backend then
    holds no cache and generates what it generated before."""
    from gguf import GGMLQuantizationType

    path = tiny.gguf("llama", GGMLQuantizationType.Q8_0)
    script = textwrap.dedent(
        f"""
        import faulthandler, signal, threading
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it hangs, if it does
        from spnl_backend import BackendSettings, EngineError, load_backend
        backend = load_backend({str(path)!r}, settings=BackendSettings(device="cpu"))
        before = backend.generate("The capital", max_tokens=20, temperature=0).token_ids
        print("ready", flush=True)
        stop = threading.Event()
        def loop():
            while not stop.is_set():
                try:
                    backend.generate("Once upon a time", max_tokens=64, temperature=0)
                except EngineError:
                    pass
        threads = [threading.Thread(target=loop) for _ in range(3)]
        for thread in threads:
            thread.start()
        try:
            while True:
                backend.generate("def add(a, b):", max_tokens=64, temperature=0)
        except KeyboardInterrupt:
            stop.set()
        for thread in threads:
            thread.join()
        stats = backend.stats()
        assert (stats.running, stats.waiting, stats.pool.in_use) == (0, 0, 0), stats
        assert backend.generate("The capital", max_tokens=20, temperature=0).token_ids == before
        print("consistent")
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "ready"
    time.sleep(delay)
    child.send_signal(signal.SIGINT)
    try:
        out, err = child.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGUSR1)
        time.sleep(2)
        child.kill()
        out, err = child.communicate()
        pytest.fail(f"the child never saw the interrupt; its threads:\n{err[-6000:]}")
    assert child.returncode == 0, f"exit {child.returncode}: {err[-2000:]}"
    assert "consistent" in out


@pytest.mark.parametrize(
    "settings",
    [{"paged_cache_type": "f8e4m3"}, {"kv_cache_compression": "fp8"}],
    ids=["fp8-pool", "fp8-codec"],
)
def test_an_fp8_cache_does_not_depend_on_which_request_came_first(tiny, settings):
    """The FP8 scales are measured at load; they used to come from the first prefill."""

    def fresh():
        full = BackendSettings(device="cpu", paged_attn=True, **settings)
        return load_backend(str(tiny.hf("llama").path), settings=full)

    alone = _greedy(fresh(), PROMPTS[0], max_tokens=24).token_ids
    after_another = fresh()
    _greedy(after_another, "x", max_tokens=1)  # a short, odd first request
    assert _greedy(after_another, PROMPTS[0], max_tokens=24).token_ids == alone
    scales = engine_internals(fresh()).cache.cache
    if settings.get("paged_cache_type"):
        assert all(scale > 0 for scale in scales.k_scale + scales.v_scale)


def test_the_library_threads_leave_ctrl_c_to_the_main_thread(tiny):
    """A Ctrl-C handed by the kernel to one of the library's threads left the main thread
    waiting on a lock: they block SIGINT, so it always reaches the main thread."""
    import signal

    from helpers import CPU

    from spnl_backend import load_backend

    backend = load_backend(str(tiny.hf("llama").path), settings=CPU)
    try:
        blocked = backend._loop.call(lambda engine: signal.pthread_sigmask(signal.SIG_BLOCK, []))
    finally:
        backend.close()
    assert signal.SIGINT in blocked
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
