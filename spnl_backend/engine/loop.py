"""The engine loop: one background thread owns the engine and steps it while any request
is unfinished.

Callers on any thread, or on an asyncio event loop, never touch the engine: they post
commands (add these sequences, abort those, run this function) to the loop's queue, and
read each request's outputs from the request's own channel. Between two steps the loop
runs the commands that came in, then hands every sequence's new outputs to its channel.
Embedding requests wait in a line of their own: after each step the loop embeds one
chunk of the first in line (`Engine.embedding_chunk_tokens`), which then goes to the
back, so that generation and each embedding request advance in turn.
A reader that falls `STREAM_BUFFER` outputs behind pauses its sequences (they are not
scheduled and give up their cache first), and one that reads nothing for
`STREAM_IDLE_TIMEOUT_S` seconds while paused is aborted.
"""

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..errors import EngineError, ModelFileError, RequestAbortedError, RequestError
from ..kernels.threads import torch_on_this_thread_alone
from ..log import get_logger
from ..signals import leave_interrupts_to_the_main_thread
from .embed import chunk_end
from .engine import Engine
from .sequence import Sequence, StepOutput

log = get_logger()

# A stream runs at most this many outputs ahead of its reader, then pauses.
STREAM_BUFFER = 64
# A paused stream whose reader has taken nothing for this long is aborted.
STREAM_IDLE_TIMEOUT_S = 60.0
# How long the loop sleeps with nothing to run before it looks at the clock again
# (paused streams' idle time); commands and readers wake it at once.
_IDLE_WAIT_S = 0.5
# How often a blocked reader checks that the loop thread is still alive.
_READER_CHECK_S = 1.0

T = TypeVar("T")


@dataclass(frozen=True)
class Finished:
    """The last item a sequence sends: it has finished (``seq.error`` says if it failed)."""

    seq: Sequence


Item = StepOutput | Finished


class Channel:
    """Where one request's items go: a list per step, in order. ``pieces`` False: only
    `Finished` items are sent (a caller who waits for the whole result). The loop thread
    counts what it sent and the reader what it took; the difference is what waits."""

    def __init__(self, pieces: bool) -> None:
        self.pieces = pieces
        self.sent = 0
        self.taken = 0
        self.read_at = time.monotonic()

    @property
    def unread(self) -> int:
        return self.sent - self.taken

    def put(self, items: list[Item]) -> bool:
        """Deliver ``items`` (on the loop thread); False when the reader is gone."""
        raise NotImplementedError

    def _took(self, items: list[Item], wake: threading.Event) -> None:
        outputs = sum(isinstance(item, StepOutput) for item in items)
        was_full = self.unread >= STREAM_BUFFER
        self.taken += outputs
        self.read_at = time.monotonic()
        if was_full:
            wake.set()  # its sequences may run again


class ThreadChannel(Channel):
    """A channel read by blocking calls from any thread."""

    def __init__(self, pieces: bool) -> None:
        super().__init__(pieces)
        self._items: deque[list[Item]] = deque()
        self._ready = threading.Condition(threading.Lock())

    def put(self, items: list[Item]) -> bool:
        with self._ready:
            self._items.append(items)
            self._ready.notify()
        return True

    def get(self, loop: "EngineLoop") -> list[Item]:
        with self._ready:
            while not self._items:
                if not self._ready.wait(_READER_CHECK_S):
                    loop.check_alive()
            items = self._items.popleft()
        self._took(items, loop.wake)
        return items


class AsyncChannel(Channel):
    """A channel read by ``await`` on the event loop that created it."""

    def __init__(self, pieces: bool) -> None:
        super().__init__(pieces)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[list[Item]] = asyncio.Queue()

    def put(self, items: list[Item]) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, items)
        except RuntimeError:  # its event loop is closed: nobody will read this
            return False
        return True

    async def get(self, loop: "EngineLoop") -> list[Item]:
        # No polling: the loop thread only ends after delivering every request's end.
        items = await self._queue.get()
        self._took(items, loop.wake)
        return items


class EngineLoop:
    """The thread that builds the engine and then steps it; every method is safe from any
    thread.

    The build runs on the loop's own thread too. The steps compute on the native kernels'
    pool (`kernels.cpu`); the thread's own torch operations run on it alone
    (`kernels.threads`), so that no second team of threads contends for the cores and
    their sums do not depend on the machine's thread count.
    """

    def __init__(
        self,
        build: Callable[[], tuple[Engine, T]],
        built: "Future[T]",
        name: str = "spnl-engine",
    ) -> None:
        self.engine: Engine = None  # type: ignore[assignment]  # set by `build`, on the thread
        self.wake = threading.Event()
        self._commands: deque[Callable[[], None]] = deque()
        self._live: dict[int, tuple[Sequence, Channel]] = {}  # by seq_id, on the loop thread
        self._embeds: deque[EmbedRequest] = deque()  # in turn, on the loop thread
        self._stopping = False
        self._thread = threading.Thread(
            target=self._main, args=(build, built), name=name, daemon=True
        )

    @classmethod
    def start(cls, build: Callable[[], tuple[Engine, T]]) -> tuple["EngineLoop", T]:
        """Run ``build`` on a new loop thread, then the loop: the loop and what ``build``
        returned beside the engine. ``build``'s exception is raised here; an interruption
        while waiting leaves the thread to finish the build and discard it."""
        built: Future[T] = Future()
        loop = cls(build, built)
        loop._thread.start()
        try:
            return loop, built.result()
        except BaseException:
            loop._stopping = True
            raise

    # ---- what callers post ------------------------------------------------------------

    def submit(self, seqs: list[Sequence], channel: Channel) -> None:
        """Add ``seqs`` to the engine; their outputs go to ``channel``."""
        self._post(lambda: self._add(seqs, channel))

    def abort(self, seqs: list[Sequence], error: Exception | None = None) -> None:
        """Abort the unfinished ones of ``seqs`` (their readers get a last `Finished`); a
        no-op once the loop has stopped, which ended every request already. Safe from a
        finalizer on any thread: it only queues the command."""
        if self._thread.is_alive():
            self._commands.append(lambda: self._abort(seqs, error))
            self.wake.set()

    def embed(self, texts: list[list[int]]) -> "EmbedRequest":
        """Queue ``texts`` (checked token ids) for embedding; read the request's vectors
        with `EmbedRequest.result` or `EmbedRequest.aresult`."""
        request = EmbedRequest(self, texts)
        self._post(lambda: self._embeds.append(request))
        return request

    def abort_embedding(self, request: "EmbedRequest") -> None:
        """Drop what ``request`` has not embedded yet (its reader gets
        `RequestAbortedError`, unless it cancelled its wait); a no-op once its vectors
        are in. Safe from any thread."""
        future = request.future
        if self._thread.is_alive() and (future.cancelled() or not future.done()):
            self._commands.append(lambda: self._drop_embedding(request))
            self.wake.set()

    def barrier(self) -> None:
        """Return once every command posted so far has run (no-op once stopped)."""
        if self._thread.is_alive():
            self.call(lambda engine: None)

    def call(self, function: Callable[[Engine], T]) -> T:
        """``function(engine)`` run on the loop thread between two steps (after every
        command posted before it), its result returned here."""
        if threading.current_thread() is self._thread:
            return function(self.engine)
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(function(self.engine))
            except Exception as exc:
                future.set_exception(exc)

        self._post(run)
        while True:
            try:
                return future.result(_READER_CHECK_S)
            except TimeoutError:
                self.check_alive()

    def close(self, error: Exception) -> None:
        """Abort every request with ``error``, then stop the thread and wait for it."""
        self._commands.append(lambda: self._close(error))
        self.wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def check_alive(self) -> None:
        if not self._thread.is_alive():
            raise EngineError("the engine loop has stopped; load a new backend")

    def _post(self, command: Callable[[], None]) -> None:
        self.check_alive()
        self._commands.append(command)
        self.wake.set()

    # ---- the loop thread ----------------------------------------------------------------

    def _main(self, build: Callable[[], tuple[Engine, T]], built: "Future[T]") -> None:
        leave_interrupts_to_the_main_thread()  # and to the threads it starts (the kernels')
        try:
            self.engine, extra = build()
        except BaseException as exc:  # raised in the caller of `start`
            built.set_exception(exc)
            return
        built.set_result(extra)
        torch_on_this_thread_alone()
        self._serve()
        self.engine.close()
        if self._stopping and not self._live:
            self.engine = None  # type: ignore[assignment]  # frees the model and cache

    def _serve(self) -> None:
        while not self._stopping:
            self.wake.clear()
            try:
                self._run_commands()
                if self._stopping:
                    break
                if not self._work() and not self.wake.wait(_IDLE_WAIT_S):
                    self.engine.idle()
            except BaseException as exc:  # the loop itself failed: nobody is left hanging
                self._fail_all(exc)
        log.debug("engine_loop.stopped")

    def _work(self) -> bool:
        """A step where a sequence may run, then an embedding chunk where one waits: False
        where there was neither."""
        stepped = self._runnable()
        if stepped:
            self._step()
        embedded = self._embed_chunk()
        if stepped and not embedded and self.engine.last_batch_size == 0:
            self.wake.wait(_IDLE_WAIT_S / 10)  # nothing fit: do not spin
        return stepped or embedded

    def _embed_chunk(self) -> bool:
        """One chunk of the first embedding request in line, which then goes to the back
        unless it is done; False where none waits. It stays in line while it runs, so that
        an interruption there fails it with the rest (`_fail_all`)."""
        if not self._embeds:
            return False
        request = self._embeds[0]
        if not request.future.cancelled():  # else its reader left
            try:
                request.run_chunk(self.engine, self.engine.embedding_chunk_tokens())
            except Exception as exc:  # this request fails alone
                log.warning("embedding.failed", error=f"{type(exc).__name__}: {exc}")
                request.settle(error=exc)
        self._embeds.popleft()
        if not request.future.done():
            self._embeds.append(request)
        return True

    def _drop_embedding(self, request: "EmbedRequest") -> None:
        if request in self._embeds:
            self._embeds.remove(request)
            log.info("embedding.aborted", texts=len(request.texts), embedded=request.next)
        request.settle(error=RequestAbortedError("the embedding request was aborted"))

    def _step(self) -> None:
        try:
            self.engine.step()
        except BaseException as exc:  # an interruption: the step failed its own batch
            log.warning("engine_loop.step_interrupted", cause=type(exc).__name__)
        self._deliver()

    def _run_commands(self) -> None:
        while self._commands:
            self._commands.popleft()()

    def _add(self, seqs: list[Sequence], channel: Channel) -> None:
        try:
            for seq in seqs:
                self.engine.add_sequence(seq)
                self._live[seq.seq_id] = (seq, channel)
        # The engine is broken, or the request's adapter cannot be held now (unloaded since
        # it was made, every slot in use, its file gone bad): this request fails alone.
        except (EngineError, RequestError, ModelFileError) as exc:
            for seq in seqs:
                if seq.seq_id in self._live:
                    self.engine.abort(seq, exc)
                else:
                    seq.finish("error", exc)
                    self._live[seq.seq_id] = (seq, channel)
        self._deliver()

    def _abort(self, seqs: list[Sequence], error: Exception | None) -> None:
        for seq in seqs:
            if seq.seq_id in self._live:
                self.engine.abort(seq, error)
        self._deliver()

    def _close(self, error: Exception) -> None:
        for seq, _ in list(self._live.values()):
            self.engine.abort(seq, error)
        self._deliver()
        self._end_embeddings(error)
        self._stopping = True

    def _end_embeddings(self, error: Exception) -> None:
        while self._embeds:
            self._embeds.popleft().settle(error=error)

    def _runnable(self) -> bool:
        """Pause the sequences whose readers are behind (aborting those idle too long);
        True when some unfinished sequence may run."""
        deadline = time.monotonic() - STREAM_IDLE_TIMEOUT_S
        runnable = aborted = False
        for seq, channel in list(self._live.values()):
            seq.paused = channel.pieces and channel.unread >= STREAM_BUFFER
            if seq.paused and channel.read_at < deadline:
                message = f"the stream was not read for {STREAM_IDLE_TIMEOUT_S:g} s"
                log.warning("request.aborted", seq_id=seq.seq_id, reason=message)
                self.engine.abort(seq, RequestAbortedError(message + "; it was aborted"))
                aborted = True
            runnable = runnable or not (seq.paused or seq.is_finished)
        if aborted:  # their readers hear of it now; otherwise the step delivers
            self._deliver()
        return runnable

    def _deliver(self) -> None:
        """Hand every sequence's new outputs, and its end, to its channel."""
        for seq_id, (seq, channel) in list(self._live.items()):
            items: list[Item] = list(seq.outbox) if channel.pieces else []
            seq.outbox.clear()
            if seq.is_finished:
                items.append(Finished(seq))
                del self._live[seq_id]
            if not items:
                continue
            channel.sent += len(items) - seq.is_finished
            if not channel.put(items) and not seq.is_finished:
                self.engine.abort(seq)  # its reader is gone (a closed event loop)

    def _fail_all(self, exc: BaseException) -> None:
        log.error("engine_loop.failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        error = EngineError(f"the engine loop failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        for seq, _ in list(self._live.values()):
            try:
                self.engine.abort(seq, error)
            except Exception:  # the engine is past saving: its readers still hear of it
                seq.finish("error", error)
        try:
            self._deliver()
        except Exception:
            log.exception("engine_loop.deliver_failed")
            self._live.clear()
        self._end_embeddings(error)


class LoopRequest:
    """One submitted request: its sequences (several completions of a prompt, or several
    prompts) and the channel they report to. Read it once, with `items` or `aitems`;
    leaving either early aborts what has not finished."""

    def __init__(self, loop: EngineLoop, seqs: list[Sequence], channel: Channel) -> None:
        self.loop, self.seqs, self.channel = loop, seqs, channel
        self._unfinished = len(seqs)

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    def items(self) -> Iterator[Item]:
        assert isinstance(self.channel, ThreadChannel)
        try:
            while not self.done:
                for item in self.channel.get(self.loop):
                    self._unfinished -= isinstance(item, Finished)
                    yield item
        finally:
            self.abort()

    async def aitems(self) -> AsyncIterator[Item]:
        assert isinstance(self.channel, AsyncChannel)
        try:
            while not self.done:
                for item in await self.channel.get(self.loop):
                    self._unfinished -= isinstance(item, Finished)
                    yield item
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort what has not finished (a no-op once all has)."""
        if not self.done:
            self.loop.abort(self.seqs)


class EmbedRequest:
    """One embedding request's texts, which the loop embeds a chunk at a time (`chunk_end`)
    in order; its vectors come back whole. Leaving `result` or `aresult` early (an
    interruption, a cancelled task) aborts it: what is not embedded yet never is."""

    def __init__(self, loop: EngineLoop, texts: list[list[int]]) -> None:
        self.loop, self.texts = loop, texts
        self.next = 0  # the first text not embedded yet
        self.future: Future[torch.Tensor] = Future()
        self._vectors: list[torch.Tensor] = []

    def run_chunk(self, engine: Engine, budget: int) -> None:
        """Embed the next texts, at most ``budget`` tokens of them (a longer text alone);
        the request is settled after its last (on the loop thread)."""
        end = chunk_end([len(ids) for ids in self.texts], self.next, budget)
        self._vectors.append(engine.embed(self.texts[self.next : end]))
        self.next = end
        if end == len(self.texts):
            self.settle(torch.cat(self._vectors))

    def settle(self, vectors: torch.Tensor | None = None, error: Exception | None = None) -> None:
        """Hand the reader ``vectors`` or ``error`` (once: a no-op when it is done, or its
        reader cancelled it)."""
        if self.future.done() or not self.future.set_running_or_notify_cancel():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(vectors)

    def result(self) -> torch.Tensor:
        """The vectors, ``[texts, hidden]``, waited for on this thread."""
        try:
            while True:
                try:
                    return self.future.result(_READER_CHECK_S)
                except TimeoutError:
                    self.loop.check_alive()
        finally:
            self.abort()

    async def aresult(self) -> torch.Tensor:
        """The vectors, awaited on an event loop."""
        try:
            return await asyncio.wrap_future(self.future)
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop what is not embedded yet (a no-op once done)."""
        self.loop.abort_embedding(self)
