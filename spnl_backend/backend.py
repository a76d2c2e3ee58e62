"""`Backend`: the one interface host applications call — generate, stream, chat, query,
embed and their asyncio twins; each request checked, its prompt made (`pic.prompts` for a
PIC prompt) and handed to the engine loop."""

import asyncio
import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from .constrain.grammar import GrammarCompiler
from .constrain.healing import back_off
from .constrain.spec import check_stops
from .engine.block_manager import BlockEvents
from .engine.cache import CacheInfo
from .engine.engine import Engine, EngineStats
from .engine.loop import AsyncChannel, EngineLoop, LoopRequest, ThreadChannel
from .engine.sequence import Sequence as EngineSequence
from .engine.sequence import StepOutput
from .errors import RequestAbortedError, RequestError
from .loader.lora import read_adapter
from .loader.model import LoadedModel
from .loader.resolve import ModelSource
from .log import get_logger
from .memory import release_freed_memory
from .models.config import ModelConfig
from .models.lora import AdapterInfo
from .models.transformer import CausalLM
from .pic.layout import PicPrompt
from .pic.prompts import PicPrompts
from .pic.query import SpanQuery
from .reasoning import (
    Reasoning,
    check_budget,
    detect_format,
    markers,
    resolve_format,
    starts_inside,
    template_variables,
)
from .reasoning.gate import GateTokens, ReasoningGate
from .request import (
    MAX_SEED,
    CacheRoom,
    ContextLimit,
    PromptIds,
    adapter_list,
    check_messages,
    check_prompt,
    prompt_list,
    sampling_params,
    token_id_prompts,
)
from .results import (
    Embeddings,
    GenerateResult,
    Stream,
    aread_results,
    raise_failure,
    read_results,
    with_calls,
    with_reasoning,
)
from .sampling import SamplingParams
from .settings import BackendSettings, PlatformDecisions
from .settings.speculation import SpeculationChoice
from .settings.values import is_adapter_name
from .tools.chat import ToolChat, one_call_a_turn, template_messages, tool_chat
from .tools.formats import ToolFormat
from .tools.spec import ToolRequest, tool_request

log = get_logger()

Prompt = str | Sequence[str] | None
TokenIds = Sequence[int] | Sequence[Sequence[int]] | None
EmbeddingInputs = str | list[str] | list[int] | list[list[int]]
Blocks = Sequence[tuple[str, str | Sequence[int]]] | None


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
        self._limit = ContextLimit(self.max_model_len, _cache_room(engine, settings, loaded))
        self._pic = PicPrompts(
            loaded.tokenizer,
            settings,
            loaded.source.name,
            loaded.config.vocab_size,
            self._limit,
            engine.cache_info.block_size or 1,
            engine.pic_refusal(),
            engine.pic_context(),
        )
        self._special_ids: dict[str, int | None] = {}  # tool-call markers, once looked up
        self._gates: dict[str, GateTokens | str] = {}  # reasoning markers' ids, once looked up
        self._grammars = GrammarCompiler(
            self.tokenizer.definition, loaded.config.vocab_size, engine.config.eos_token_ids
        )
        self._loop: EngineLoop | None = loop
        self._closing = threading.Lock()

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
        return read_results(self.submit(prompts, params), single)

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
        return Stream(lambda: self.submit([ids], params, pieces=True))

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
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
        **unknown: object,
    ) -> GenerateResult:
        """Apply the model's chat template to ``messages`` and complete the assistant turn.

        ``tools`` (OpenAI's function tools), ``tool_choice`` (``"auto"``, ``"none"``,
        ``"required"`` or ``{"type": "function", "function": {"name": ...}}``) and
        ``parallel_tool_calls``: the model may answer with calls, held to its own call
        syntax and each tool's parameter schema; they come back in ``tool_calls``.
        ``chat_template_kwargs`` (``enable_thinking``...) and ``reasoning_effort``
        (``low``, ``medium``, ``high``): template variables. A reasoning model's reasoning
        comes back in ``reasoning``, its answer alone in ``text``; ``thinking_token_budget``
        (an option, as vLLM names it) bounds the reasoning's tokens within ``max_tokens``,
        and a constraint holds the answer after it (`reasoning.gate`)."""
        params = self._chat_params(unknown, (max_tokens, temperature, top_p, top_k, seed, stop))
        asked = tool_request(tools, tool_choice, parallel_tool_calls)
        variables = template_variables(chat_template_kwargs, reasoning_effort)
        prompt = self.chat_prompt_ids(messages, asked, variables)
        chat = self.tool_chat(asked, params) if asked is not None else ToolChat(None, None)
        if chat.constraint is not None:
            params = dataclasses.replace(params, constraint=chat.constraint)
        params, reasoning = self._reasoning_params(prompt, params, chat.format)
        result = read_results(self.submit([prompt], params), single=True)
        return with_calls(with_reasoning(result, reasoning), chat)

    def query(
        self, query: "str | dict | SpanQuery", *, adapters: object = None
    ) -> list[GenerateResult]:
        """Run one of spnl's span queries (its JSON text, as spnl's ``spnl/`` provider
        posts it to ``/v1/query/execute``, that JSON as a dict, or a parsed `SpanQuery`):
        a ``repeat``'s
        ``n`` completions of its input, or a ``map``'s completion of each input, in
        order. Tokenized as spnl tokenizes it (`pic.spans`); plus elements reused under
        ``MISTRALRS_SPAN_QUERY_REUSE`` (spnl's rule by default), under its LoRA
        ``adapters`` alone (as `generate` takes them; None: the base model)."""
        prompts, params, n = self.span_query_request(query)
        if adapters is not None:
            params = dataclasses.replace(params, adapters=adapter_list(adapters))
        return read_results(self.submit(prompts, params, n=n), single=False)

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
        return await aread_results(await self.asubmit(prompts, params), single)

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
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
        **unknown: object,
    ) -> GenerateResult:
        """`chat` for asyncio (without tools)."""
        params = self._chat_params(unknown, (max_tokens, temperature, top_p, top_k, seed, stop))
        variables = template_variables(chat_template_kwargs, reasoning_effort)
        prompt = await asyncio.to_thread(self.chat_prompt_ids, messages, None, variables)
        params, reasoning = self._reasoning_params(prompt, params)
        request = await self.asubmit([prompt], params)
        result = await aread_results(request, single=True)
        return with_reasoning(result, reasoning)  # type: ignore[arg-type]

    async def _astream(self, ids: list[int], params: SamplingParams) -> AsyncIterator[str]:
        request = await self.asubmit([ids], params, pieces=True)
        async for item in request.aitems():
            raise_failure(item)
            if isinstance(item, StepOutput) and item.text_delta:
                yield item.text_delta

    # ---- the lower level: what the server and the CLI build on ------------------------------

    def submit(
        self,
        prompts: list[PromptIds],
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
        loop, seqs = self._built(prompts, params, n)
        channel = AsyncChannel(pieces) if asynchronous else ThreadChannel(pieces)
        loop.submit(seqs, channel)
        return LoopRequest(loop, seqs, channel)

    async def asubmit(
        self, prompts: list[PromptIds], params: SamplingParams, *, n: int = 1, pieces: bool = False
    ) -> LoopRequest:
        """`submit` from an event loop, read with `aitems`: the sequences (a grammar
        compiled, token healing's index, the vocabulary's view) are built on a worker
        thread, so that nothing a request needs stalls the loop."""
        loop, seqs = await asyncio.to_thread(self._built, prompts, params, n)
        channel = AsyncChannel(pieces)
        loop.submit(seqs, channel)
        return LoopRequest(loop, seqs, channel)

    def _built(
        self, prompts: list[PromptIds], params: SamplingParams, n: int
    ) -> tuple[EngineLoop, list[EngineSequence]]:
        """The checked prompts' sequences, each with what it needs built, and the loop
        they go to."""
        loop = self._open_loop()
        for prompt in prompts if isinstance(prompts, list) else [None]:
            ids = prompt.token_ids if isinstance(prompt, PicPrompt) else prompt
            if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
                raise RequestError(
                    "submit takes a list of checked prompts (lists of token ids, or PIC "
                    "prompts): see prompt_ids and chat_prompt_ids"
                )
        self._check_token_ids(params)
        if params.speculative and loop.engine.speculation is None:
            raise RequestError(
                f"speculative={params.speculative}: this backend decodes without speculation "
                f"({loop.engine.speculation_why}); load it with "
                "MISTRALRS_SPECULATIVE_METHOD=ngram or suffix (or a draft model) for it, "
                "or leave speculative out"
            )
        if params.logprobs:
            self._grammars.tokenizer  # noqa: B018  # built now, not in a response
        seqs = [
            seq for prompt in prompts for seq in self._sequences(loop.engine, prompt, params, n)
        ]
        return loop, seqs

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
        self, engine: Engine, prompt: PromptIds, params: SamplingParams, n: int
    ) -> list[EngineSequence]:
        """``n`` completions of ``prompt``, each with its own constraint: its grammar's
        matcher, or with token healing (a plain prompt only), the first token's."""
        healed = None
        if params.token_healing and isinstance(prompt, list):
            healed = back_off(prompt, self._grammars.prefix_index(), self.tokenizer.decode)
        seqs = _completions(engine, healed.kept_ids if healed else prompt, params, n)
        gate = self._gate_tokens_for(params)
        for seq in seqs:
            if params.constraint is not None:
                seq.constraint = self._grammars.compile(params.constraint)
            elif healed is not None:
                seq.constraint, seq.healed_text = healed.constraint(), healed.text
            if gate is not None:  # the reasoning first: the constraint holds the answer
                reasoning = params.reasoning
                seq.constraint = ReasoningGate(
                    gate,
                    params.reasoning_budget,
                    seq.constraint,
                    reasoning.inside,  # type: ignore[union-attr]
                    self.tokenizer.decode,
                    spanning=_spans_reasoning(params),
                )
        return seqs

    def _gate_tokens_for(self, params: SamplingParams) -> GateTokens | None:
        """The marker ids a sequence's `ReasoningGate` follows, where ``params`` bound the
        reasoning (a budget) or constrain a reasoning answer; None where nothing does. A
        budget this model's reasoning markers cannot be followed for is a `RequestError`."""
        reasoning, budget = params.reasoning, params.reasoning_budget
        if reasoning is None or reasoning.format == "none":
            return None  # no reasoning to bound: a budget is kept trivially
        if budget is None and (params.constraint is None or _spans_reasoning(params)):
            return None  # nothing to bound, or a grammar over the whole output (harmony's)
        tokens = self._gate_tokens(reasoning.format)
        if isinstance(tokens, str):
            if budget is None:
                return None  # the constraint holds the whole output (`reasoning`)
            raise RequestError(
                f"a reasoning budget cannot be kept for this model ({reasoning.format} "
                f"reasoning): {tokens}"
            )
        return tokens

    def _gate_tokens(self, fmt: str) -> GateTokens | str:
        """``fmt``'s marker ids in this vocabulary, or why there are none."""
        if fmt not in self._gates:
            self._gates[fmt] = GateTokens.build(
                fmt, self._single_token, self.tokenizer.encode_plain
            )
        return self._gates[fmt]

    def _single_token(self, text: str) -> int | None:
        """``text``'s token where the vocabulary tokenizes it as one token."""
        ids = self.tokenizer.encode_plain(text)
        return ids[0] if len(ids) == 1 else None

    def prepare(self, params: SamplingParams) -> None:
        """Build what ``params`` need, in the calling thread: the vocabulary's view for a
        constraint, token healing or log-probabilities (seconds, once per backend), and
        the constraint compiled once (a `RequestError` where it does not compile).
        `submit` does the same (`asubmit` on a worker thread); this is for a host that
        wants a bad constraint refused, or the work done, before it submits."""
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

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """Each token's bytes as the model's vocabulary has them (what logprobs name)."""
        return self._grammars.token_bytes(token_ids)

    def run_steps(self, prompts: list[str], params: SamplingParams) -> Iterator[StepOutput]:
        """Every step's outputs for a batch (what the CLI's progress display follows)."""
        request = self.submit([self._encode(p) for p in prompt_list(prompts)], params, pieces=True)
        for item in request.items():
            raise_failure(item)
            if isinstance(item, StepOutput):
                yield item

    def chat_prompt_ids(
        self,
        messages: list[Any],
        tools: ToolRequest | None = None,
        variables: dict[str, Any] | None = None,
        template: str | None = None,
    ) -> PromptIds:
        """``messages`` through the model's chat template (with the ``tools`` offered and
        more template ``variables``, such as ``enable_thinking``), checked against the
        context: a PIC prompt where a message is marked plus or messages are grouped (a
        list)."""
        messages = template_messages(messages) if isinstance(messages, list) else messages
        definitions = [tool.definition() for tool in tools.tools] if tools is not None else None
        pic = (
            self._pic.from_chat(messages) if tools is None and isinstance(messages, list) else None
        )
        if pic is not None:
            if variables or template is not None:
                raise RequestError(
                    "template variables (chat_template_kwargs, reasoning_effort, think) and a "
                    "request's chat_template are not applied to plus or grouped messages, "
                    "which are templated one by one"
                )
            return pic
        checked = check_messages(messages)
        self._limit.check_chars(sum(len(m["content"]) for m in checked), "the messages' content")
        own = self.tokenizer.hf.chat_template if template is None else template
        if detect_format(own) == "harmony":
            one_call_a_turn(checked)
        ids = self.tokenizer.apply_chat_template(
            checked, definitions, self._variables(variables), template
        )
        if not ids:
            raise RequestError("the chat template rendered these messages as no text at all")
        return self._limit.check(ids)

    def _variables(self, variables: dict[str, Any] | None) -> dict[str, Any] | None:
        """A chat's template variables over the server-wide defaults
        (``MISTRALRS_DEFAULT_CHAT_TEMPLATE_KWARGS``): the request's own win."""
        defaults = self.settings.default_chat_template_kwargs
        if defaults is None:
            return variables
        return {**json.loads(defaults), **(variables or {})}

    def reasoning(
        self,
        prompt: PromptIds,
        constrained: bool = False,
        tools: ToolFormat | None = None,
        template: str | None = None,
    ) -> Reasoning:
        """How the answer to the chat ``prompt`` is read (`reasoning`): the format in
        effect (``MISTRALRS_REASONING_FORMAT``, or the chat template's: ``template``, the
        request's own, where it gave one) and whether the output starts inside the
        reasoning because the prompt opened it. A constraint holds the answer after the
        reasoning (`reasoning.gate`) where the markers are tokens; elsewhere it holds the
        whole output, never read as inside the reasoning. ``tools``: the format the
        answer's calls are read in; harmony's calls are read by the harmony parser, which
        then needs the harmony format in effect."""
        template = self.tokenizer.hf.chat_template if template is None else template
        fmt = resolve_format(self.settings.reasoning_format, template)
        if tools is not None and tools.syntax == "harmony":
            if fmt != "harmony":
                raise RequestError(
                    "this model calls tools in gpt-oss's harmony messages, which only the "
                    f"harmony reasoning format reads; the reasoning format in effect is {fmt!r} "
                    "(MISTRALRS_REASONING_FORMAT): set it to 'auto' or 'harmony'"
                )
            return Reasoning(fmt, calls=True)
        if fmt == "none":
            return Reasoning(fmt)
        ids = prompt.token_ids if isinstance(prompt, PicPrompt) else prompt
        tail = self.tokenizer.decode_keeping(ids[-8:], frozenset(self.reasoning_kept(fmt)))
        # A constraint waits for the reasoning's end where the engine can see it
        # (`reasoning.gate`); elsewhere it holds the whole output, all of it the answer.
        lazy = not isinstance(self._gate_tokens(fmt), str)
        return Reasoning(fmt, (lazy or not constrained) and starts_inside(fmt, tail))

    def _reasoning_params(
        self, prompt: PromptIds, params: SamplingParams, tools: ToolFormat | None = None
    ) -> tuple[SamplingParams, Reasoning]:
        """How a chat's answer to ``prompt`` is read for reasoning (and, harmony, for the
        calls in ``tools``' format), and ``params`` keeping the markers its parser reads."""
        reasoning = self.reasoning(prompt, params.constraint is not None, tools)
        kept = params.kept_token_ids + self.reasoning_kept(reasoning.format)
        return dataclasses.replace(params, kept_token_ids=kept, reasoning=reasoning), reasoning

    def reasoning_kept(self, fmt: str) -> tuple[int, ...]:
        """The ids of ``fmt``'s markers that are special tokens: the output's text must keep
        them (`SamplingParams.kept_token_ids`) for its parser to read them."""
        return tuple(i for text in markers(fmt) if (i := self._special_id(text)) is not None)

    def tool_chat(
        self, tools: ToolRequest, params: SamplingParams, template: str | None = None
    ) -> ToolChat:
        """How an answer with ``tools`` is read and held (a `RequestError` where this
        model's template has no tool calls, or ``params`` constrain the output already)."""
        template = self.tokenizer.hf.chat_template if template is None else template
        chat = tool_chat(tools, template, self._special_id)
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

    def embed(self, texts: EmbeddingInputs) -> "Embeddings":
        """The embeddings of ``texts`` (a string, a list of strings, a list of token ids,
        or a list of such lists): the model's last hidden states pooled as its config says
        (`engine.embed`), each of unit length. The engine's loop embeds them in chunks
        between its steps (`EngineLoop.embed`), so that running requests go on; an
        interruption while waiting drops the texts not embedded yet."""
        prompts = self._embedding_inputs(texts)
        vectors = self._open_loop().embed(prompts).result()
        return Embeddings(vectors, [len(ids) for ids in prompts])

    async def aembed(self, texts: EmbeddingInputs) -> "Embeddings":
        """`embed` for asyncio (the texts tokenized on a worker thread); cancelling the
        awaiting task drops the texts not embedded yet."""
        prompts = await asyncio.to_thread(self._embedding_inputs, texts)
        vectors = await self._open_loop().embed(prompts).aresult()
        return Embeddings(vectors, [len(ids) for ids in prompts])

    def _embedding_inputs(self, texts: EmbeddingInputs) -> list[list[int]]:
        if self.model.tp is not None:
            raise RequestError("embeddings are not served under tensor parallelism yet")
        return _embedding_inputs(texts, self)

    def span_query_request(
        self, query: "str | dict | SpanQuery"
    ) -> tuple[list[PromptIds], SamplingParams, int]:
        """spnl's span query (its JSON text, that JSON as a dict, or a parsed `SpanQuery`)
        as what `submit` takes: its prompts, sampling parameters and completions per
        prompt (`PicPrompts.query_request`)."""
        return self._pic.query_request(query)

    def span_query_prompts(self, query: SpanQuery) -> list[PromptIds]:
        """spnl's span query as checked prompts (`PicPrompts.from_query`)."""
        return self._pic.from_query(query)

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
        in paged mode, state slots and snapshots held (a model with state layers);
        preemptions and prefix-cache queries and hits (in prompt tokens) since the model
        was loaded. Taken between two steps, after every earlier call's
        request or abort has reached the engine."""
        return self._open_loop().call(Engine.stats)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix and PIC element (what ``/reset_prefix_cache`` does):
        the next requests compute from scratch, while the running ones go on with what
        they hold. Returns how many blocks (or, without paged attention, sequences) were
        forgotten."""
        return self._open_loop().call(Engine.reset_prefix_cache)

    def adapters(self) -> list[AdapterInfo]:
        """The LoRA adapters known to the model (MISTRALRS_LORA_ADAPTERS, and those loaded
        since), in load order, which a request chooses by name (``adapter=``); ``loaded``
        says which are held in memory now."""
        adapters = self._open_loop().engine.adapters
        return [] if adapters is None else list(adapters.listed)

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load the LoRA adapter at ``path`` (a PEFT directory or a GGUF adapter file) as
        ``name`` while the backend runs: read and checked here, then known to requests
        from the next step on. A `ModelFileError` for a bad file, a `RequestError` for a
        bad or taken name."""
        loop = self._open_loop()
        if not isinstance(name, str) or not is_adapter_name(name):
            raise RequestError(
                f"lora_name={name!r}: expected letters, digits and . _ : / - (a letter or "
                "digit first)"
            )
        if not isinstance(path, str) or not path:
            raise RequestError(f"lora_path={path!r}: expected a path")
        if loop.engine.adapters is None:
            raise RequestError(loop.engine.no_adapters or "this model takes no LoRA adapters")
        if any(a.name == name for a in self.adapters()):  # before reading the files
            raise RequestError(f"a LoRA adapter named {name!r} is loaded already")
        adapter = read_adapter(name, path, loop.engine.runner.model)
        return loop.call(lambda engine: engine.load_adapter(adapter))

    def unload_adapter(self, name: str) -> None:
        """Forget the LoRA adapter ``name`` and free its memory. An `AdapterInUseError`
        while unfinished requests run with it (they keep their output: retry once they
        finish); requests made before and not yet started fail with a `RequestError`."""
        self._open_loop().call(lambda engine: engine.unload_adapter(name))

    def watch_blocks(self, events: BlockEvents | None) -> int:
        """Tell ``events`` (on the engine's thread) of every block the prefix cache
        registers and forgets from now on, None to stop; returns the block size. What
        ``serve --kv-events`` publishes."""
        return self._open_loop().call(lambda engine: engine.watch_blocks(events))

    def cache_info(self) -> CacheInfo:
        """The KV cache: paged or contiguous, its capacity, blocks, storage dtype, bytes per
        token, compression method and attention kernels (the target's, with a draft); for
        a model with state layers, the state group's bytes per sequence, slots, snapshots
        and their bytes."""
        return self._open_loop().engine.cache_info

    def speculation(self) -> SpeculationChoice:
        """What proposes the tokens the target verifies ("draft", "ngram", "suffix", or
        None: no speculation), as the engine runs it, and why (MISTRALRS_SPECULATIVE_METHOD
        resolved: auto is the draft where one is set, else ngram where it can run)."""
        engine = self._open_loop().engine
        return SpeculationChoice(engine.speculation, engine.speculation_why)

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
        options = dict(options)
        budget = check_budget(options.pop("thinking_token_budget", None))
        params = self._checked({**options, "token_healing": False}, sampling)
        return dataclasses.replace(params, reasoning_budget=budget)

    def _one_stream(
        self,
        prompt: object,
        prompt_token_ids: object,
        blocks: object,
        unknown: dict[str, object],
        sampling: tuple[Any, ...],
    ) -> tuple[PromptIds, SamplingParams]:
        params = self._checked(unknown, sampling)
        if prompt is not None and not isinstance(prompt, str):
            raise RequestError(f"a stream takes one prompt string, not {type(prompt).__name__}")
        prompts, single = self.prompt_ids(prompt, prompt_token_ids, blocks)
        if not single:
            raise RequestError("a stream takes one prompt: a list of token ids, not of lists")
        return prompts[0], params

    def prompt_ids(
        self, prompt: object = None, token_ids: object = None, blocks: object = None
    ) -> tuple[list[PromptIds], bool]:
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
            return [self._pic.from_blocks(blocks)], True
        if token_ids is not None:
            prompts, single = token_id_prompts(token_ids, self.model_config.vocab_size)
            return [self._pic.from_token_ids(ids) for ids in prompts], single
        if isinstance(prompt, str):
            return [self._encode(check_prompt(prompt))], True
        return [self._encode(p) for p in prompt_list(prompt)], False

    def _open_loop(self) -> EngineLoop:
        loop = self._loop
        if loop is None:
            raise RequestAbortedError("the backend is closed; load a new one")
        return loop

    def _encode(self, prompt: str) -> list[int]:
        self._limit.check_chars(len(prompt))
        return self._limit.check(self.tokenizer.encode(prompt))


def _completions(
    engine: Engine, prompt: PromptIds, params: SamplingParams, n: int
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


def _nth_seed(params: SamplingParams, i: int) -> SamplingParams:
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % (MAX_SEED + 1))


def _embedding_inputs(texts: object, backend: "Backend") -> list[list[int]]:
    """The texts as token ids, each non-empty and within the context."""
    if isinstance(texts, list) and texts and not isinstance(texts[0], str):
        prompts, _ = token_id_prompts(texts, backend.model_config.vocab_size)
    else:
        items = [texts] if isinstance(texts, str) else prompt_list(texts)
        prompts = []
        for i, text in enumerate(items):
            backend._limit.check_chars(len(check_prompt(text)), f"input[{i}]")
            prompts.append(backend.tokenizer.encode(text))
    for i, ids in enumerate(prompts):
        if not ids:
            raise RequestError(f"input[{i}] has no tokens; give some text")
        backend._limit.check(ids)
    return prompts


def _spans_reasoning(params: SamplingParams) -> bool:
    """Whether ``params``' constraint holds the reasoning too: gpt-oss's tool-call grammar
    (`tools.harmony`), which writes the analysis message before the answer or call."""
    reasoning, constraint = params.reasoning, params.constraint
    return (
        reasoning is not None
        and reasoning.calls
        and constraint is not None
        and constraint.kind == "tools"
    )


def _cache_room(engine: Engine, settings: BackendSettings, loaded: LoadedModel) -> CacheRoom | None:
    """What sizes the paged KV cache, where it (not the model's context) limits a prompt."""
    info = engine.cache_info
    if info.capacity_tokens != engine.config.max_model_len or info.block_size is None:
        return None
    return CacheRoom(
        settings.kv_budget.kind,
        info.block_size,
        info.bytes_per_token,
        loaded.config.max_position_embeddings,
        info.window_bytes_per_token or 0,
        info.window_most_tokens or 0,
    )
