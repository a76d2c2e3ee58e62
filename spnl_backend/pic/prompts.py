"""A backend's PIC prompts: each way a request marks its plus spans (`pic.pieces`) made
into a `PicPrompt` under the backend's settings, and checked against what its engine can
run and hold, so that `Backend` only hands the prompt on."""

import dataclasses
from typing import TYPE_CHECKING, Any

from ..errors import ContextLengthError, RequestError
from ..request import ContextLimit, PromptIds, sampling_params
from ..sampling import SamplingParams
from ..settings import BackendSettings
from ..settings.pic import pic_sentinels
from .layout import PicPrompt
from .pieces import (
    block_pieces,
    chat_pieces,
    has_marker,
    make_prompt,
    query_pieces,
    split_sentinels,
)
from .query import MapQuery, Repeat, SpanQuery, message_chars, parse_query, query_text
from .spans import Pieces, SpanTokenizer
from .turns import ModelTurns, SpnlTurns, Turns

if TYPE_CHECKING:  # the tokenizer is handed in; the loader is a layer above
    from ..loader.tokenizer import Tokenizer


class PicPrompts:
    """The PIC prompts of one loaded model: from ``generate(blocks=...)``, sentinel ids,
    marked chat messages and spnl's span queries."""

    def __init__(
        self,
        tokenizer: "Tokenizer",
        settings: BackendSettings,
        model_name: str,
        vocab_size: int,
        limit: ContextLimit,
        block_size: int,
        refusal: str | None,
        pic_context: int | None = None,
    ) -> None:
        """``refusal``: why the engine cannot run PIC prompts (`Engine.pic_refusal`), or None;
        ``pic_context``: the tokens a PIC sequence holds where fewer than ``limit``'s
        (`Engine.pic_context`)."""
        self._tokenizer, self._settings, self._model_name = tokenizer, settings, model_name
        self._vocab_size, self._limit, self._block_size = vocab_size, limit, block_size
        self._refusal = refusal
        self._pic_context = pic_context or limit.max_model_len
        self._sentinels = pic_sentinels()
        if self._sentinels is not None:
            self._sentinels.check_vocabulary(vocab_size)
        self._spans: SpanTokenizer | None = None

    def from_blocks(self, blocks: object) -> PicPrompt:
        """``generate(blocks=...)``: each block's text tokenized alone (no special tokens),
        after the BOS the tokenizer starts a prompt with, which is cross."""
        tokenizer = self._tokenizer
        bos = tokenizer.encode("")
        return self.from_pieces(block_pieces(blocks, tokenizer.encode_plain, self._vocab_size, bos))

    def from_token_ids(self, ids: list[int]) -> PromptIds:
        """Checked token ids: a PIC prompt where the ``SPNL_PIC_*`` sentinels are in them,
        else the ids themselves."""
        sentinels, settings = self._sentinels, self._settings
        found = None
        if sentinels is not None:
            found = split_sentinels(ids, sentinels, settings.pic_positions, settings.pic_reuse)
        return self._limit.check(ids) if found is None else self._checked(found)

    def from_chat(self, messages: list[Any]) -> PicPrompt | None:
        """Chat messages as a PIC prompt where one is marked plus or messages are grouped
        (each templated alone), else None."""
        if not has_marker(messages):
            return None
        max_chars = self._limit.max_chars
        pieces = chat_pieces(messages, self._span_tokenizer(), max_chars)
        return None if pieces is None else self.from_pieces(pieces)

    def query_request(
        self, query: "str | dict | SpanQuery"
    ) -> tuple[list[PromptIds], SamplingParams, int]:
        """spnl's span query (its JSON text, that JSON as a dict, or a parsed `SpanQuery`)
        as what `Backend.submit` takes: its prompts, sampling parameters and completions
        per prompt."""
        if isinstance(query, dict):
            query = query_text(query)
        parsed = parse_query(query) if isinstance(query, str) else query
        self._check_query_size(parsed)
        meta = parsed.metadata
        params = sampling_params(meta.max_tokens, meta.temperature)
        n = parsed.n if isinstance(parsed, Repeat) else 1
        return self.from_query(parsed), params, n

    def from_query(self, query: SpanQuery) -> list[PromptIds]:
        """spnl's span query (`pic.query`) as checked prompts, tokenized as spnl does
        (`pic.spans`): a generate's input, or each input of a map. A prompt with a plus
        element is a PIC prompt under ``MISTRALRS_SPAN_QUERY_REUSE`` (spnl's rule by
        default); one without, plain token ids."""
        prompts: list[PromptIds] = []
        for pieces in query_pieces(query, self._span_tokenizer()):
            if any(kind == "plus" for kind, _ in pieces):
                prompts.append(self.from_pieces(pieces, self._settings.span_query_reuse))
            else:
                prompts.append(self._limit.check([t for _, ids in pieces for t in ids]))
        return prompts

    def _check_query_size(self, query: SpanQuery) -> None:
        """Each prompt of a span query within what the context could hold, counted in
        characters before anything is tokenized (a map's inputs each, a generate's
        messages together)."""
        if isinstance(query, MapQuery):
            sized = [(f"query.map.inputs[{i}]", len(t)) for i, t in enumerate(query.inputs)]
        else:
            sized = [("the query's input", message_chars(query.input))]
        for where, chars in sized:
            self._limit.check_chars(chars, where)

    def _span_tokenizer(self) -> SpanTokenizer:
        """How span queries and plus chat messages are tokenized (made once)."""
        if self._spans is None:
            turns: Turns
            if self._settings.span_template == "spnl":
                turns = SpnlTurns(self._model_name)
            else:
                turns = ModelTurns(self._tokenizer.render_chat)
            self._spans = SpanTokenizer(turns, self._tokenizer.encode_plain, self._block_size)
        return self._spans

    def from_pieces(self, pieces: Pieces, reuse: str | None = None) -> PicPrompt:
        """A PIC prompt under ``reuse`` (``MISTRALRS_PIC_REUSE`` where None)."""
        settings = self._settings
        prompt = make_prompt(pieces, settings.pic_positions, reuse or settings.pic_reuse)
        return self._checked(prompt)

    def _checked(self, prompt: PicPrompt) -> PicPrompt:
        """A PIC prompt the engine can run, whose spans (each from a new block) fit, with
        ``MISTRALRS_PIC_RECOMPUTE``'s fraction of each element recomputed (picked by
        ``MISTRALRS_PIC_RECOMPUTE_SELECT``)."""
        if self._refusal is not None:
            raise RequestError(f"this backend cannot run PIC prompts: {self._refusal}")
        layout = dataclasses.replace(
            prompt.layout,
            recompute=self._settings.pic_recompute,
            recompute_select=self._settings.pic_recompute_select,
        )
        prompt = PicPrompt(prompt.token_ids, layout)
        size, max_len = self._block_size, self._pic_context
        slots = prompt.layout.padded_slots(size)
        if slots + size >= max_len:
            holds = (
                f"a sequence holds {max_len}"
                if max_len == self._limit.max_model_len
                else f"a PIC sequence holds {max_len}, all of them in the sliding-window "
                "layers' own pool,"
            )
            raise ContextLengthError(
                f"the PIC prompt has {len(prompt.token_ids)} tokens, {slots} with each span "
                f"starting a new block of {size}, but {holds} (prompt and completion "
                f"together); {self._remedy(prompt)}"
            )
        return prompt

    def _remedy(self, prompt: PicPrompt) -> str:
        """What would let a PIC prompt that does not fit run: the largest smaller block
        size it fits with (many short spans each pad a block), else shortening it."""
        max_len = self._pic_context
        for smaller in (s for s in (64, 32, 16, 8) if s < self._block_size):
            if prompt.layout.padded_slots(smaller) + smaller < max_len:
                return (
                    f"with blocks of {smaller} it takes {prompt.layout.padded_slots(smaller)}"
                    f": set MISTRALRS_PAGED_ATTN_BLOCK_SIZE={smaller}, or shorten it"
                )
        return "shorten it"
