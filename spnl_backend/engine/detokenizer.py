"""Token ids → text deltas as they are generated, and stop-string detection."""

from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class KeptTokens:
    """A decoder that writes out some special tokens (``kept``) the inner one leaves out."""

    def __init__(self, decoder: Decoder, kept: tuple[int, ...]) -> None:
        self.decoder, self.kept = decoder, frozenset(kept)

    def decode(self, token_ids: list[int]) -> str:
        return self.decoder.decode_keeping(token_ids, self.kept)  # type: ignore[attr-defined]


_CONTEXT_TOKENS = 5  # decoded before the new ones, so tokenizers keep leading spaces


class IncrementalDetokenizer:
    """Emits the text each new token adds.

    Incomplete UTF-8 sequences are held back until complete, and so are the last
    characters that could still begin a stop string, so a streamed delta never
    has to be taken back. ``text`` ends before the first stop string found (after it with
    ``keep_stop``). ``skip``:
    text the completion starts with that is not its own (token healing's backed-off
    prompt text), left out of ``text``.
    """

    def __init__(
        self,
        decoder: Decoder,
        prompt_ids: list[int],
        stop: tuple[str, ...],
        skip: str = "",
        keep_stop: bool = False,
    ) -> None:
        self.decoder = decoder
        self.token_ids = list(prompt_ids)
        self.prefix_offset = max(len(prompt_ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(prompt_ids)
        self.stop = stop
        self.keep_stop = keep_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.skip = len(skip)
        self.sent = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string the text ended at

    def add(self, token_id: int) -> str:
        """Append a token; returns the text that is now safe to show (possibly empty)."""
        self.token_ids.append(token_id)
        if not self.stopped:
            self._decode_new(final=False)
        end = len(self.text) if self.stopped else len(self.text) - self.holdback
        return self._send(end)

    def flush(self) -> str:
        """Everything not yet shown, at the end of generation."""
        if not self.stopped:
            self._decode_new(final=True)
        return self._send(len(self.text))

    def _send(self, end: int) -> str:
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent += len(delta)
        return delta

    def _decode_new(self, final: bool) -> None:
        prefix = self.decoder.decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self.decoder.decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        before = len(self.text)
        piece = full[len(prefix) :]
        cut = min(self.skip, len(piece))
        self.skip -= cut
        self.text += piece[cut:]
        self._cut_at_stop(search_from=max(before - self.holdback, 0))

    def _cut_at_stop(self, search_from: int) -> None:
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) != -1]
        if hits:
            # the first match; of those that start there, the longest (it was typed whole)
            at, self.matched = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            self.text = self.text[: at + len(self.matched) if self.keep_stop else at]
            self.stopped = True
