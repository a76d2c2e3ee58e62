"""`Backend`: the one interface host applications call — generate, stream, chat."""

import asyncio
import atexit
import dataclasses
import os
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .constrain.grammar import GrammarCompiler
from .constrain.healing import back_off
from .constrain.spec import check_stops
from .engine.build import build_engine
from .engine.cache import CacheInfo
from .engine.engine import Engine, EngineStats
from .engine.loop import AsyncChannel, EngineLoop, Finished, Item, LoopRequest, ThreadChannel
from .engine.sampler import TokenLogprobs
from .engine.sequence import SamplingParams, StepOutput
from .engine.sequence import Sequence as EngineSequence
from .engine.speculative import SpeculativeRunner
from .errors import ContextLengthError, RequestAbortedError, RequestError, SettingsError
from .loader.build import LoadedModel, load_model
from .loader.default_model import default_model_path
from .loader.draft import load_draft
from .loader.progress import LogProgress, Progress, TqdmProgress
from .loader.resolve import ModelSource, resolve_model
from .log import get_logger, set_verbose
from .memory import release_freed_memory
from .models.config import ModelConfig
from .models.transformer import CausalLM
from .pic.layout import PicPrompt
from .pic.query import Repeat, SpanQuery, parse_query, query_text
from .pic.requests import (
    block_pieces,
    chat_pieces,
    has_marker,
    make_prompt,
    query_pieces,
    split_sentinels,
)
from .pic.spans import SpanTokenizer
from .pic.turns import ModelTurns, SpnlTurns, Turns
from .request import (
    MAX_SEED,
    check_messages,
    check_prompt,
    prompt_list,
    sampling_params,
    token_id_prompts,
)
from .settings import BackendSettings, PlatformDecisions, detect_platform, load_settings
from .settings.pic import pic_sentinels
from .settings.topology import (
    Topology,
    check_distributed_settings,
    check_layer_map_settings,
    decide_layer_map,
    decide_topology,
    launch_environment,
)
from .tools.calls import ToolCall, read_whole
from .tools.chat import ToolChat, template_messages, tool_chat
from .tools.spec import ToolRequest, tool_request

log = get_logger()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens reused from the prefix cache
    ttft_s: float  # from the request to its first token
    decode_tok_s: float  # completion tokens after the first, per second
    draft_tokens: int = 0  # proposed by the speculative draft (0 without one)
    accepted_tokens: int = 0  # of those, accepted by the target
    # Of a PIC prompt's plus tokens, those whose K/V the pool had (reused) and those
    # computed (0 and 0 for a plain prompt).
    pic_hit_tokens: int = 0
    pic_miss_tokens: int = 0
    # Of the reused prompt tokens (cached ones and PIC hits), those whose K/V the KV tier
    # read back from disk (0 without a tier).
    tier_hit_tokens: int = 0


@dataclass(frozen=True)
class GenerateResult:
    text: str
    token_ids: list[int]  # the completion's tokens (an EOS that ended it included)
    finish_reason: str  # "stop" (EOS, a stop string or a stop token) or "length"
    usage: Usage
    # With ``logprobs=True``: each token's log-probability and its ``top_logprobs``
    # likeliest alternatives (`TokenLogprobs`), one per entry of ``token_ids``.
    logprobs: list[TokenLogprobs] | None = None
    # A chat with tools whose answer called them: the calls (its ``text`` is then the
    # calls as the model wrote them, and ``finish_reason`` "tool_calls"; cut short by
    # max_tokens, the calls made whole before the cut, and "length").
    tool_calls: list[ToolCall] | None = None


@dataclass(frozen=True)
class Embeddings:
    vectors: "torch.Tensor"  # [texts, hidden] float32, each row of unit length
    token_counts: list[int]  # each text's tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)


EMBED_PASS_TOKENS = 8192  # tokens one embedding pass packs at most


# Backends not closed yet: closed at interpreter exit, so that no engine thread is still
# inside a step while the interpreter tears torch down.
_OPEN: "weakref.WeakSet[Backend]" = weakref.WeakSet()


@atexit.register
def _close_open_backends() -> None:
    for backend in list(_OPEN):
        backend.close()


Prompt = str | Sequence[str] | None
TokenIds = Sequence[int] | Sequence[Sequence[int]] | None
Blocks = Sequence[tuple[str, str | Sequence[int]]] | None
PromptIds = list[int] | PicPrompt  # a checked prompt: token ids, or a PIC prompt
# More characters than any token takes: a PIC chat with more content than this many per
# token of the context cannot fit, and is refused before its turns are rendered.
MAX_CHARS_PER_TOKEN = 64


class Backend:
    """A loaded model behind `generate`, `stream` and `chat` (and their asyncio twins
    `agenerate`, `astream`, `achat`); safe to share between threads and event loops.

    One background thread (the engine loop) steps the model for every caller, so
    concurrent requests batch together. Also a context manager: leaving the ``with`` block
    (or `close`) frees everything.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        loop: EngineLoop,
        settings: BackendSettings,
        platform: PlatformDecisions,
    ) -> None:
        engine = loop.engine
        self.settings, self.platform = settings, platform
        self.tokenizer = loaded.tokenizer
        self.model_config: ModelConfig = loaded.config
        self.source: ModelSource = loaded.source
        self.max_model_len = engine.config.max_model_len
        self.max_num_seqs = engine.config.max_num_seqs  # sequences one step runs at most
        self._cache_holds_context = engine.cache.capacity_tokens == self.max_model_len
        self._block_size = engine.cache_info.block_size or 1
        self._pic_refusal = _pic_refusal(engine)
        self._sentinels = pic_sentinels()
        self._spans: SpanTokenizer | None = None
        self._special_ids: dict[str, int | None] = {}  # tool-call markers, once looked up
        if self._sentinels is not None:
            self._sentinels.check_vocabulary(loaded.config.vocab_size)
        self._grammars = GrammarCompiler(
            self.tokenizer.definition, loaded.config.vocab_size, engine.config.eos_token_ids
        )
        self._loop: EngineLoop | None = loop
        self._closing = threading.Lock()
        _OPEN.add(self)

    # ---- blocking calls -------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt = None,
        *,
        prompt_token_ids: TokenIds = None,
        blocks: Blocks = None,
        max_tokens: int | None = None,
        temperature: float = 0.6,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        **unknown: object,
    ) -> GenerateResult | list[GenerateResult]:
        """Complete one prompt, or a list of prompts run together as one batch.

        The prompt is text, or token ids (``prompt_token_ids``: a list of ids, or a list
        of such lists), or ``blocks`` (a PIC prompt: a list of ``("cross" | "plus", text
        or token ids)``), exactly one of them; token ids with the ``SPNL_PIC_*`` sentinels
        in them are a PIC prompt too. ``max_tokens`` of 0 or None runs until EOS or the end
        of the context; ``temperature`` 0 is greedy. Returns a list exactly when given a
        list; if one of its prompts fails, the call raises that error and the others are
        aborted.
        """
        params = self._checked(unknown, (max_tokens, temperature, top_p, top_k, seed, stop))
        prompts, single = self.prompt_ids(prompt, prompt_token_ids, blocks)
        return _results(self.submit(prompts, params), single)

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        blocks: Blocks = None,
        max_tokens: int | None = None,
        temperature: float = 0.6,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        **unknown: object,
    ) -> "Stream":
        """Yield the completion's text in pieces as it is decoded.

        The request starts with the first ``next()``. Closing the iterator, letting it be
        garbage-collected or leaving the loop aborts it; one left unread pauses after
        `STREAM_BUFFER` pieces and is aborted after `STREAM_IDLE_TIMEOUT_S` seconds.
        """
        ids, params = self._one_stream(
            prompt,
            prompt_token_ids,
            blocks,
            unknown,
            (max_tokens, temperature, top_p, top_k, seed, stop),
        )
        return Stream(self, ids, params)

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float = 0.6,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **unknown: object,
    ) -> GenerateResult:
        """Apply the model's chat template to ``messages`` and complete the assistant turn.

        ``tools`` (OpenAI's function tools), ``tool_choice`` (``"auto"``, ``"none"``,
        ``"required"`` or ``{"type": "function", "function": {"name": ...}}``) and
        ``parallel_tool_calls``: the model may answer with calls, held to its own call
        syntax and each tool's parameter schema; they come back in ``tool_calls``."""
        params = self._chat_params(unknown, (max_tokens, temperature, top_p, top_k, seed, stop))
        asked = tool_request(tools, tool_choice, parallel_tool_calls)
        prompt = self.chat_prompt_ids(messages, asked)
        chat = self.tool_chat(asked, params) if asked is not None else ToolChat(None, None)
        if chat.constraint is not None:
            params = dataclasses.replace(params, constraint=chat.constraint)
        result = _results(self.submit([prompt], params), single=True)
        return _with_calls(result, chat)

    def query(self, query: "str | dict | SpanQuery") -> list[GenerateResult]:
        """Run one of spnl's span queries (its JSON text, as spnl's ``spnl/`` provider
        posts it to ``/v1/query/execute``, that JSON as a dict, or a parsed `SpanQuery`):
        a ``repeat``'s
        ``n`` completions of its input, or a ``map``'s completion of each input, in
        order. Tokenized as spnl tokenizes it (`pic.spans`); plus elements reused under
        ``MISTRALRS_SPAN_QUERY_REUSE`` (spnl's rule by default)."""
        prompts, params, n = self.span_query_request(query)
        return _results(self.submit(prompts, params, n=n), single=False)

    # ---- asyncio --------------------------------------------------------------------------

    async def agenerate(
        self,
        prompt: Prompt = None,
        *,
        prompt_token_ids: TokenIds = None,
        blocks: Blocks = None,
        max_tokens: int | None = None,
        temperature: float = 0.6,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        **unknown: object,
    ) -> GenerateResult | list[GenerateResult]:
        """`generate` for asyncio: the event loop runs on while the engine works."""
        params = self._checked(unknown, (max_tokens, temperature, top_p, top_k, seed, stop))
        prompts, single = self.prompt_ids(prompt, prompt_token_ids, blocks)
        await self._aprepare(params)
        return await _aresults(self.submit(prompts, params, asynchronous=True), single)

    def astream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        blocks: Blocks = None,
        max_tokens: int | None = None,
        temperature: float = 0.6,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        **unknown: object,
    ) -> AsyncIterator[str]:
        """`stream` for asyncio (``async for piece in backend.astream(...)``). Bad
        parameters raise here; the request starts with the first piece asked for.
        Cancelling the task that reads it, or closing it, aborts the request."""
        ids, params = self._one_stream(
            prompt,
            prompt_token_ids,
            blocks,
            unknown,
            (max_tokens, temperature, top_p, top_k, seed, stop),
        )
        return self._astream(ids, params)

    async def achat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float = 0.6,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        **unknown: object,
    ) -> GenerateResult:
        """`chat` for asyncio."""
        params = self._chat_params(unknown, (max_tokens, temperature, top_p, top_k, seed, stop))
        prompt = self.chat_prompt_ids(messages)
        await self._aprepare(params)
        request = self.submit([prompt], params, asynchronous=True)
        return await _aresults(request, single=True)  # type: ignore[return-value]

    async def _astream(self, ids: list[int], params: SamplingParams) -> AsyncIterator[str]:
        await self._aprepare(params)
        request = self.submit([ids], params, pieces=True, asynchronous=True)
        async for item in request.aitems():
            _raise_failure(item)
            if isinstance(item, StepOutput) and item.text_delta:
                yield item.text_delta

    # ---- the lower level: what the server and the CLI build on ------------------------------

    def submit(
        self,
        prompts: list["PromptIds"],
        params: SamplingParams,
        *,
        n: int = 1,
        pieces: bool = False,
        asynchronous: bool = False,
    ) -> LoopRequest:
        """Hand checked token-id prompts to the engine loop: ``n`` completions of each (the
        prompt computed once, its blocks shared; a seeded request's completion ``i`` draws
        with ``seed + i``), in that order. ``pieces``: every step's outputs are delivered,
        not only each sequence's end. Read the request from this thread (`items`) or, with
        ``asynchronous``, from this event loop (`aitems`)."""
        loop = self._open_loop()
        for prompt in prompts if isinstance(prompts, list) else [None]:
            ids = prompt.token_ids if isinstance(prompt, PicPrompt) else prompt
            if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
                raise RequestError(
                    "submit takes a list of checked prompts (lists of token ids, or PIC "
                    "prompts): see prompt_ids and chat_prompt_ids"
                )
        self._check_token_ids(params)
        seqs = [
            seq for prompt in prompts for seq in self._sequences(loop.engine, prompt, params, n)
        ]
        channel = AsyncChannel(pieces) if asynchronous else ThreadChannel(pieces)
        loop.submit(seqs, channel)
        return LoopRequest(loop, seqs, channel)

    def _check_token_ids(self, params: SamplingParams) -> None:
        """The ids ``params`` name within this model's vocabulary: parameters checked
        without it (the server's, or built by hand for `submit`) must not reach a step,
        where an id past the logits would fail every request in it."""
        check_stops(params.constraint, params.stop, params.stop_token_ids)
        vocab = self.model_config.vocab_size
        if any(token >= vocab for token, _ in params.logit_bias) or any(
            token >= vocab for token in params.stop_token_ids
        ):
            raise RequestError(
                f"logit_bias and stop_token_ids take token ids from 0 to {vocab - 1}"
            )

    def _sequences(
        self, engine: Engine, prompt: "PromptIds", params: SamplingParams, n: int
    ) -> list[EngineSequence]:
        """``n`` completions of ``prompt``, each with its own constraint: its grammar's
        matcher, or with token healing (a plain prompt only), the first token's."""
        healed = None
        if params.token_healing and isinstance(prompt, list):
            healed = back_off(prompt, self._grammars.prefix_index(), self.tokenizer.decode)
        seqs = _completions(engine, healed.kept_ids if healed else prompt, params, n)
        for seq in seqs:
            if params.constraint is not None:
                seq.constraint = self._grammars.compile(params.constraint)
            elif healed is not None:
                seq.constraint, seq.healed_text = healed.constraint(), healed.text
        return seqs

    def prepare(self, params: SamplingParams) -> None:
        """Build what ``params`` need, in the calling thread: the vocabulary's view for a
        constraint, token healing or log-probabilities (seconds, once per backend), and
        the constraint compiled once (a `RequestError` where it does not compile).
        `submit` does the same; the server calls this first, off its event loop."""
        check_stops(params.constraint, params.stop, params.stop_token_ids)
        if params.constraint is not None:
            self._grammars.compile(params.constraint)
        elif params.token_healing:
            self._grammars.prefix_index()
        elif params.logprobs:
            self._grammars.tokenizer  # noqa: B018  # built now, not in a response

    def prepare_constraints(self) -> None:
        """Build the grammar library's view of the vocabulary now rather than on the first
        constrained request: its native code holds the GIL throughout (about 4 s for the
        default model's 262,144 tokens), which would stall the host's other threads
        (a server's event loop) in the middle of its work."""
        self._grammars.tokenizer  # noqa: B018  # built now

    async def _aprepare(self, params: SamplingParams) -> None:
        """`prepare` off the event loop where ``params`` need anything built (a grammar
        compiles, the vocabulary's view is built: seconds the loop must not stall for)."""
        if params.constraint is not None or params.token_healing or params.logprobs:
            await asyncio.to_thread(self.prepare, params)

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """Each token's bytes as the model's vocabulary has them (what logprobs name)."""
        return self._grammars.token_bytes(token_ids)

    def run_steps(self, prompts: list[str], params: SamplingParams) -> Iterator[StepOutput]:
        """Every step's outputs for a batch (what the CLI's progress display follows)."""
        request = self.submit([self._encode(p) for p in prompt_list(prompts)], params, pieces=True)
        for item in request.items():
            _raise_failure(item)
            if isinstance(item, StepOutput):
                yield item

    def chat_prompt_ids(self, messages: list[Any], tools: ToolRequest | None = None) -> "PromptIds":
        """``messages`` through the model's chat template (with the ``tools`` offered),
        checked against the context: a PIC prompt where a message is marked plus or
        messages are grouped (a list)."""
        messages = template_messages(messages) if isinstance(messages, list) else messages
        if tools is not None:
            definitions = [tool.definition() for tool in tools.tools]
            checked = check_messages(messages)
            return self._check_length(self.tokenizer.apply_chat_template(checked, definitions))
        if isinstance(messages, list) and has_marker(messages):
            max_chars = MAX_CHARS_PER_TOKEN * self.max_model_len
            pieces = chat_pieces(messages, self._span_tokenizer(), max_chars)
            if pieces is not None:
                return self._pic_prompt(pieces)
        return self._check_length(self.tokenizer.apply_chat_template(check_messages(messages)))

    def tool_chat(self, tools: ToolRequest, params: SamplingParams) -> ToolChat:
        """How an answer with ``tools`` is read and held (a `RequestError` where this
        model's template has no tool calls, or ``params`` constrain the output already)."""
        chat = tool_chat(tools, self.tokenizer.hf.chat_template, self._special_id)
        if chat.constraint is not None and params.constraint is not None:
            raise RequestError(
                "tools that may be called constrain the answer to their calls' syntax: give "
                "tool_choice 'none' to constrain a text answer's format instead"
            )
        return chat

    def _special_id(self, text: str) -> int | None:
        """``text``'s token where the vocabulary has it as one special token."""
        if text not in self._special_ids:  # get_vocab builds a dict of the whole vocabulary
            self._special_ids[text] = self._find_special(text)
        return self._special_ids[text]

    def _find_special(self, text: str) -> int | None:
        token = self.tokenizer.hf.get_vocab().get(text)
        special = self._grammars.tokenizer.is_special_token  # type: ignore[attr-defined]
        return token if token is not None and special(token) else None

    def embed(self, texts: str | list[str] | list[int] | list[list[int]]) -> "Embeddings":
        """The embeddings of ``texts`` (a string, a list of strings, a list of token ids,
        or a list of such lists): the model's last hidden states pooled as its config says
        (`engine.embed`), each of unit length, run on the engine's thread between steps in
        passes of at most `EMBED_PASS_TOKENS` tokens (so that running requests go on)."""
        if self.model.tp is not None:
            raise RequestError("embeddings are not served under tensor parallelism yet")
        prompts = _embedding_inputs(texts, self)
        loop, vectors = self._open_loop(), []
        for batch in _passes(prompts, EMBED_PASS_TOKENS):
            vectors.append(loop.call(lambda engine, batch=batch: engine.embed(batch)))
        return Embeddings(torch.cat(vectors), [len(ids) for ids in prompts])

    def span_query_request(
        self, query: "str | dict | SpanQuery"
    ) -> tuple[list["PromptIds"], SamplingParams, int]:
        """spnl's span query (its JSON text, that JSON as a dict, or a parsed `SpanQuery`)
        as what `submit` takes: its prompts, sampling parameters and completions per
        prompt."""
        if isinstance(query, dict):
            query = query_text(query)
        parsed = parse_query(query) if isinstance(query, str) else query
        meta = parsed.metadata
        params = sampling_params(meta.max_tokens, meta.temperature)
        n = parsed.n if isinstance(parsed, Repeat) else 1
        return self.span_query_prompts(parsed), params, n

    def span_query_prompts(self, query: SpanQuery) -> list["PromptIds"]:
        """spnl's span query (`pic.query`) as checked prompts, tokenized as spnl does
        (`pic.spans`): a generate's input, or each input of a map. A prompt with a plus
        element is a PIC prompt under ``MISTRALRS_SPAN_QUERY_REUSE`` (spnl's rule by
        default); one without, plain token ids."""
        prompts: list[PromptIds] = []
        for pieces in query_pieces(query, self._span_tokenizer()):
            if any(kind == "plus" for kind, _ in pieces):
                prompts.append(self._pic_prompt(pieces, self.settings.span_query_reuse))
            else:
                prompts.append(self._check_length([t for _, ids in pieces for t in ids]))
        return prompts

    def _span_tokenizer(self) -> SpanTokenizer:
        """How span queries and plus chat messages are tokenized (made once)."""
        if self._spans is None:
            turns: Turns
            if self.settings.span_template == "spnl":
                turns = SpnlTurns(self.source.name)
            else:
                turns = ModelTurns(self.tokenizer.render_chat)
            self._spans = SpanTokenizer(turns, self.tokenizer.encode_plain, self._block_size)
        return self._spans

    # ---- PIC prompts ----------------------------------------------------------------------

    def _block_pieces(self, blocks: object) -> list[tuple[str, list[int]]]:
        """``generate(blocks=...)``: each block's text tokenized alone (no special tokens),
        after the BOS the tokenizer starts a prompt with, which is cross."""
        tokenizer = self.tokenizer
        vocab = self.model_config.vocab_size
        return block_pieces(blocks, tokenizer.encode_plain, vocab, tokenizer.encode(""))

    def _split_sentinels(self, ids: list[int]) -> "PromptIds":
        sentinels, settings = self._sentinels, self.settings
        found = None
        if sentinels is not None:
            found = split_sentinels(ids, sentinels, settings.pic_positions, settings.pic_reuse)
        return self._check_length(ids) if found is None else self._checked_pic(found)

    def _pic_prompt(
        self, pieces: list[tuple[str, list[int]]], reuse: str | None = None
    ) -> PicPrompt:
        """A PIC prompt under ``reuse`` (``MISTRALRS_PIC_REUSE`` where None)."""
        settings = self.settings
        prompt = make_prompt(pieces, settings.pic_positions, reuse or settings.pic_reuse)  # type: ignore[arg-type]
        return self._checked_pic(prompt)

    def _checked_pic(self, prompt: PicPrompt) -> PicPrompt:
        """A PIC prompt this backend can run, whose spans (each from a new block) fit."""
        if self._pic_refusal is not None:
            raise RequestError(f"this backend cannot run PIC prompts: {self._pic_refusal}")
        size = self._block_size
        slots = prompt.layout.padded_slots(size)
        if slots + size >= self.max_model_len:
            raise ContextLengthError(
                f"the PIC prompt has {len(prompt.token_ids)} tokens, {slots} with each span "
                f"starting a new block of {size}, but a sequence holds {self.max_model_len} "
                f"(prompt and completion together); {self._pic_remedy(prompt, size)}"
            )
        return prompt

    def _pic_remedy(self, prompt: PicPrompt, size: int) -> str:
        """What would let a PIC prompt that does not fit run: the largest smaller block
        size it fits with (many short spans each pad a block), else shortening it."""
        for smaller in (s for s in (64, 32, 16, 8) if s < size):
            if prompt.layout.padded_slots(smaller) + smaller < self.max_model_len:
                return (
                    f"with blocks of {smaller} it takes {prompt.layout.padded_slots(smaller)}"
                    f": set MISTRALRS_PAGED_ATTN_BLOCK_SIZE={smaller}, or shorten it"
                )
        return "shorten it"

    # ---- state ----------------------------------------------------------------------------

    def close(self) -> None:
        """Abort every unfinished request (its caller gets `RequestAbortedError`), stop the
        engine loop and free the model and its KV cache. Later calls raise
        `RequestAbortedError`; closing twice is fine."""
        with self._closing:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        loop.close(RequestAbortedError("the backend was closed"))
        del loop
        self._grammars.clear()
        release_freed_memory()
        log.info("backend.closed", model=self.source.name)

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._loop is None

    def stats(self) -> EngineStats:
        """Requests running, waiting and paused, sequences holding cache, block-pool usage
        in paged mode; preemptions and prefix-cache queries and hits (in prompt tokens)
        since the model was loaded. Taken between two steps, after every earlier call's
        request or abort has reached the engine."""
        return self._open_loop().call(Engine.stats)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix and PIC element (what ``/reset_prefix_cache`` does):
        the next requests compute from scratch, while the running ones go on with what
        they hold. Returns how many blocks (or, without paged attention, sequences) were
        forgotten."""
        return self._open_loop().call(Engine.reset_prefix_cache)

    def cache_info(self) -> CacheInfo:
        """The KV cache: paged or contiguous, its capacity, blocks, storage dtype, bytes per
        token, compression method and attention kernels (the target's, with a draft)."""
        return self._open_loop().engine.cache_info

    @property
    def model(self) -> CausalLM:
        """The loaded torch module, for inspection (its modules, parameters and config);
        changing it while the backend serves requests is not supported."""
        return self._open_loop().engine.runner.model

    # ---- helpers --------------------------------------------------------------------------

    def _checked(self, options: dict[str, object], sampling: tuple[Any, ...]) -> SamplingParams:
        """The sampling parameters, once the backend is known open (``options``: the
        keywords beyond the common six, `request.OPTION_NAMES`)."""
        self._open_loop()
        params = sampling_params(*sampling, vocab_size=self.model_config.vocab_size, **options)
        return params if options.get("token_healing") is not None else self.default_healing(params)

    def default_healing(self, params: SamplingParams) -> SamplingParams:
        """``params`` of a completion that did not say whether to heal its prompt: healed
        where MISTRALRS_TOKEN_HEALING says so and no constraint takes the first token."""
        if self.settings.token_healing and params.constraint is None:
            return dataclasses.replace(params, token_healing=True)
        return params

    def _chat_params(self, options: dict[str, object], sampling: tuple[Any, ...]) -> SamplingParams:
        """A chat's parameters: never healed (its prompt ends with the template's own
        generation prompt, not text cut short)."""
        if options.get("token_healing"):
            raise RequestError(
                "token_healing applies to completions: a chat prompt ends with the chat "
                "template's turn marker, not with text cut short"
            )
        return self._checked({**options, "token_healing": False}, sampling)

    def _one_stream(
        self,
        prompt: object,
        prompt_token_ids: object,
        blocks: object,
        unknown: dict[str, object],
        sampling: tuple[Any, ...],
    ) -> tuple["PromptIds", SamplingParams]:
        params = self._checked(unknown, sampling)
        if prompt is not None and not isinstance(prompt, str):
            raise RequestError(f"a stream takes one prompt string, not {type(prompt).__name__}")
        prompts, single = self.prompt_ids(prompt, prompt_token_ids, blocks)
        if not single:
            raise RequestError("a stream takes one prompt: a list of token ids, not of lists")
        return prompts[0], params

    def prompt_ids(
        self, prompt: object = None, token_ids: object = None, blocks: object = None
    ) -> tuple[list["PromptIds"], bool]:
        """The prompts as checked token ids (text encoded, ids checked against the
        vocabulary, each against the context; PIC prompts with their layouts), and whether
        one was given, not a list."""
        if sum(given is not None for given in (prompt, token_ids, blocks)) != 1:
            raise RequestError(
                "give a prompt (a string or a list of strings), prompt_token_ids (a list of "
                "token ids, or a list of such lists) or blocks (a list of (kind, content) "
                "pairs): exactly one of them"
            )
        if blocks is not None:
            return [self._pic_prompt(self._block_pieces(blocks))], True
        if token_ids is not None:
            prompts, single = token_id_prompts(token_ids, self.model_config.vocab_size)
            return [self._split_sentinels(ids) for ids in prompts], single
        if isinstance(prompt, str):
            return [self._encode(check_prompt(prompt))], True
        return [self._encode(p) for p in prompt_list(prompt)], False

    def _open_loop(self) -> EngineLoop:
        loop = self._loop
        if loop is None:
            raise RequestAbortedError("the backend is closed; load a new one")
        return loop

    def _encode(self, prompt: str) -> list[int]:
        return self._check_length(self.tokenizer.encode(prompt))

    def _check_length(self, ids: list[int]) -> list[int]:
        if len(ids) >= self.max_model_len:
            if self._cache_holds_context:
                holder = "the whole paged KV cache (the MISTRALRS_PAGED_ATTN_* budget)"
                remedy = "raise MISTRALRS_PAGED_ATTN_CONTEXT_LEN or shorten it"
            else:
                holder, remedy = "the model's context", "shorten it"
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens, but {holder} holds "
                f"{self.max_model_len} (prompt and completion together); {remedy}"
            )
        return ids


class Stream(Iterator[str]):
    """The text pieces of one completion as it is decoded (what `Backend.stream` returns).

    Read from one thread at a time; `close` (from any thread), garbage collection or
    leaving the loop aborts the request."""

    def __init__(self, backend: Backend, ids: list[int], params: SamplingParams) -> None:
        self.request: LoopRequest | None = None  # once the first piece is asked for
        self._backend, self._ids, self._params = backend, ids, params
        self._items: Iterator[Item] | None = None
        self._reading = threading.Lock()

    @property
    def seq(self) -> EngineSequence | None:
        return None if self.request is None else self.request.seqs[0]

    def __next__(self) -> str:
        if not self._reading.acquire(blocking=False):
            raise RequestError("this stream is being read by another thread; read it from one")
        try:
            if self._items is None:
                self.request = self._backend.submit([self._ids], self._params, pieces=True)
                self._items = self.request.items()
            for item in self._items:
                _raise_failure(item)
                if isinstance(item, StepOutput) and item.text_delta:
                    return item.text_delta
            raise StopIteration
        finally:
            self._reading.release()

    def close(self) -> None:
        """Abort the request, and return once its cache is free; a thread reading the
        stream meanwhile sees it end."""
        if self.request is None:
            return
        if self._reading.acquire(blocking=False):
            try:
                if self._items is not None:
                    self._items.close()
            finally:
                self._reading.release()
        else:
            self.request.abort()
        self.request.loop.barrier()


def _completions(
    engine: Engine, prompt: "PromptIds", params: SamplingParams, n: int
) -> list[EngineSequence]:
    """``n`` completions: the first leads, the others wait for its prompt and share it. A
    PIC prompt's blocks are shared through the pool's keys: only with prefix caching on
    do the others wait (without it they would wait to compute it all the same)."""
    ids, pic = (
        (prompt.token_ids, prompt.layout) if isinstance(prompt, PicPrompt) else (prompt, None)
    )
    leader = engine.new_sequence(ids, params, pic=pic)
    follows = leader if pic is None or engine.config.prefix_caching else None
    others = [
        engine.new_sequence(ids, _nth_seed(params, i), leader=follows, pic=pic) for i in range(1, n)
    ]
    return [leader, *others]


def _pic_refusal(engine: Engine) -> str | None:
    """Why PIC prompts cannot run on this engine's cache, or None where they can."""
    info = engine.cache_info
    if info.kind != "paged":
        return (
            "it runs without paged attention (MISTRALRS_PAGED_ATTN=false, or the platform's "
            "default); PIC lives in the paged pool"
        )
    if info.compression is not None:
        return f"its KV cache is compressed (MISTRALRS_KV_CACHE_COMPRESSION={info.compression})"
    if isinstance(engine.runner, SpeculativeRunner):
        return (
            "it decodes with a speculative draft (MISTRALRS_SPECULATIVE_DRAFT_MODEL or "
            "MISTRALRS_SPECULATIVE_DRAFT_ISQ)"
        )
    return None


def _nth_seed(params: SamplingParams, i: int) -> SamplingParams:
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % (MAX_SEED + 1))


def _results(request: LoopRequest, single: bool) -> Any:
    """Wait for ``request`` on this thread: its results (one, or a list)."""
    for item in request.items():
        _raise_failure(item)
    results = [_result(seq) for seq in request.seqs]
    return results[0] if single else results


async def _aresults(request: LoopRequest, single: bool) -> Any:
    """`_results` on the event loop."""
    async for item in request.aitems():
        _raise_failure(item)
    results = [_result(seq) for seq in request.seqs]
    return results[0] if single else results


def _embedding_inputs(texts: object, backend: "Backend") -> list[list[int]]:
    """The texts as token ids, each non-empty and within the context."""
    if isinstance(texts, list) and texts and not isinstance(texts[0], str):
        prompts, _ = token_id_prompts(texts, backend.model_config.vocab_size)
    else:
        items = [texts] if isinstance(texts, str) else prompt_list(texts)
        prompts = [backend.tokenizer.encode(check_prompt(text)) for text in items]
    for i, ids in enumerate(prompts):
        if not ids:
            raise RequestError(f"input[{i}] has no tokens; give some text")
        backend._check_length(ids)
    return prompts


def _passes(prompts: list[list[int]], budget: int) -> Iterator[list[list[int]]]:
    """``prompts`` in order, in groups of at most ``budget`` tokens (a longer one alone)."""
    group: list[list[int]] = []
    for ids in prompts:
        if group and sum(map(len, group)) + len(ids) > budget:
            yield group
            group = []
        group.append(ids)
    if group:
        yield group


def _with_calls(result: GenerateResult, chat: ToolChat) -> GenerateResult:
    """``result`` with the calls its text makes, where it was read for them."""
    if chat.format is None:
        return result
    calls = read_whole(chat.format, result.text)
    if calls is None:
        return result
    if result.finish_reason == "length":  # cut short: the calls made whole before the cut
        return dataclasses.replace(result, tool_calls=calls)
    return dataclasses.replace(result, tool_calls=calls, finish_reason="tool_calls")


def _raise_failure(item: Item) -> None:
    if isinstance(item, Finished) and item.seq.error is not None:
        raise item.seq.error


def _result(seq: EngineSequence) -> GenerateResult:
    completion = len(seq.output_token_ids)
    ttft = (seq.first_token_time or seq.arrival_time) - seq.arrival_time
    decode_time = (seq.finish_time or 0.0) - (seq.first_token_time or 0.0)
    decode_rate = (completion - 1) / decode_time if completion > 1 and decode_time > 0 else 0.0
    usage = Usage(
        len(seq.prompt_token_ids),
        completion,
        seq.num_cached_tokens,
        ttft,
        decode_rate,
        seq.num_draft_tokens,
        seq.num_accepted_tokens,
        seq.num_pic_hit_tokens,
        seq.num_pic_miss_tokens,
        seq.num_tier_hit_tokens,
    )
    return GenerateResult(
        seq.text,
        list(seq.output_token_ids),
        seq.finish_reason or "stop",
        usage,
        list(seq.logprobs) if seq.params.logprobs else None,
    )


def load_backend(
    model: str | os.PathLike[str] | None = None,
    settings: BackendSettings | None = None,
    *,
    progress: Progress | None = None,
) -> Backend:
    """Load a model (the argument, else ``MISTRALRS_MODEL``, else the embedded default).

    ``settings`` default to the MISTRALRS_* environment; ``progress`` receives loading
    progress (by default progress bars where stderr is a terminal, else ``load.progress``
    log events), called from the backend's engine thread, which loads the model while
    this call waits. A load that fails or is interrupted ends the bars' lines first.
    """
    _check_load_arguments(model, settings, progress)
    if settings is None:
        settings = load_settings()
    else:
        set_verbose(settings.verbose)
    decisions = detect_platform(settings)
    name = os.fspath(model) if model is not None else settings.model
    source = (
        resolve_model(name)
        if name
        else ModelSource("gguf", default_model_path(), "embedded default")
    )
    log.info("model.resolved", name=source.name, kind=source.kind, path=str(source.path))
    progress = progress or (TqdmProgress() if sys.stderr.isatty() else LogProgress())
    try:
        return _load(source, settings, decisions, progress)
    except BaseException:
        close = getattr(progress, "close", None)
        if close is not None:
            close()
        raise


def _load(
    source: ModelSource,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    progress: Progress,
) -> Backend:
    topology = decide_topology(
        settings, decisions.device_type, decisions.cuda_device_count, launch_environment()
    )
    layer_map = decide_layer_map(
        settings, topology, decisions.device_type, decisions.cuda_device_count
    )
    if topology.distributed:
        return _load_distributed(source, settings, decisions, topology, progress)
    if layer_map is not None:
        check_layer_map_settings(settings, decisions)

    def build() -> tuple[Engine, LoadedModel]:
        loaded = load_model(source, settings.isq, decisions, progress, layer_map=layer_map)
        draft = load_draft(loaded, settings, decisions, progress)
        engine = build_engine(loaded, settings, decisions, draft)
        return engine, loaded

    loop, loaded = EngineLoop.start(build)  # built on the thread that will step it
    backend = Backend(loaded, loop, settings, decisions)
    release_freed_memory()
    return backend


def _load_distributed(
    source: ModelSource,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    topology: Topology,
    progress: Progress,
) -> Backend:
    """A model over several ranks (`distributed`): this process is its machine's first.
    Rank 0 returns the backend; any other first rank follows rank 0's steps until rank 0
    closes, then ends its process (under torchrun, every rank but 0)."""
    from .distributed.driver import Ranks, check_model_splits, start_ranks
    from .distributed.launch import rank_decisions
    from .distributed.worker import follow

    check_distributed_settings(settings, decisions)
    check_model_splits(source, topology.world_size)
    decisions = rank_decisions(decisions, topology)
    log.info("distributed.topology", why=topology.why, rank=topology.rank)

    def load_share() -> tuple[LoadedModel, Ranks]:
        split, ranks = start_ranks(source, settings, decisions, topology)
        try:
            return load_model(source, settings.isq, decisions, progress, split=split), ranks
        except BaseException:
            ranks.stop()
            raise

    def build() -> tuple[Engine, LoadedModel]:
        loaded, ranks = load_share()
        try:
            draft = load_draft(loaded, settings, decisions, progress)  # whole, on rank 0
            engine = build_engine(loaded, settings, decisions, draft)
            ranks.attach(engine, settings)
        except BaseException:
            ranks.stop()
            raise
        return engine, loaded

    if topology.rank != 0:
        loaded, ranks = load_share()
        try:
            follow(loaded, ranks.tp, settings, decisions)
        finally:
            ranks.stop()
        raise SystemExit(0)
    loop, loaded = EngineLoop.start(build)
    backend = Backend(loaded, loop, settings, decisions)
    release_freed_memory()
    return backend


def _check_load_arguments(model: object, settings: object, progress: object) -> None:
    if (model is not None and not isinstance(model, str | os.PathLike)) or (
        isinstance(model, os.PathLike) and not isinstance(os.fspath(model), str)
    ):
        raise SettingsError(
            f"model={type(model).__name__}: expected a model name or path (str or os.PathLike)"
        )
    if settings is not None and not isinstance(settings, BackendSettings):
        raise SettingsError(
            f"settings={type(settings).__name__}: expected a BackendSettings "
            "(build one with BackendSettings(field=value, ...))"
        )
    if progress is not None and not callable(progress):
        raise SettingsError(
            f"progress={type(progress).__name__}: expected a callable (stage, done, total)"
        )
