"""The draft of a speculative pair: loaded like any model, checked against the target.

``MISTRALRS_SPECULATIVE_DRAFT_MODEL`` names the draft; ``MISTRALRS_SPECULATIVE_DRAFT_ISQ``
quantizes it in situ, and without a draft model it makes the draft from the target
itself (a GGUF target's blocks are requantized). Both models must share a vocabulary.
"""

from ..errors import ModelFileError, SettingsError, SpnlError
from ..log import get_logger
from ..settings import BackendSettings, PlatformDecisions
from .model import LoadedModel, load_model
from .progress import Progress
from .resolve import ModelSource, resolve_model
from .tokenizer import Tokenizer

log = get_logger()


def load_draft(
    target: LoadedModel,
    settings: BackendSettings,
    decisions: PlatformDecisions,
    progress: Progress,
) -> LoadedModel | None:
    """The draft model the settings ask for, or None when speculation is off."""
    name, isq = settings.speculative_draft_model, settings.speculative_draft_isq
    if name is None and isq is None:
        return None
    try:
        source = resolve_model(name) if name else target.source
        same = source.path.resolve() == target.source.path.resolve()
        draft = load_model(
            source,
            isq,
            decisions,
            progress,
            requantize_gguf=True,
            tokenizer=target.tokenizer if same else None,
            model_impl=settings.model_impl,
        )
    except (SpnlError, OSError, ValueError) as exc:
        described = f"MISTRALRS_SPECULATIVE_DRAFT_MODEL={name}" if name else "the target"
        kind = type(exc) if isinstance(exc, SpnlError) else ModelFileError
        raise kind(f"the speculative draft ({described}) failed to load: {exc}") from exc
    if not same:
        check_shared_vocabulary(target.tokenizer, draft.tokenizer, target.source, source)
    log.info(
        "speculative.enabled",
        target=target.source.name,
        draft=source.name if name else f"the target under ISQ {isq.value}",  # type: ignore[union-attr]
        draft_isq=isq.value if isq else None,
        gamma=settings.speculative_gamma,
    )
    return draft


def check_shared_vocabulary(
    target: Tokenizer, draft: Tokenizer, target_source: ModelSource, draft_source: ModelSource
) -> None:
    """Raise unless both tokenizers map every id to the same token."""
    target_tokens, draft_tokens = _tokens_by_id(target), _tokens_by_id(draft)
    if target_tokens == draft_tokens:
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(target_tokens, draft_tokens, strict=False)) if a != b),
        min(len(target_tokens), len(draft_tokens)),
    )
    target_token = target_tokens[first] if first < len(target_tokens) else "(none)"
    draft_token = draft_tokens[first] if first < len(draft_tokens) else "(none)"
    raise SettingsError(
        f"the speculative draft {draft_source.name!r} does not share the vocabulary of the "
        f"target {target_source.name!r}: token id {first} is {target_token!r} in the target "
        f"and {draft_token!r} in the draft ({len(target_tokens):,} vs {len(draft_tokens):,} "
        "tokens); choose a draft from the same model family "
        "(MISTRALRS_SPECULATIVE_DRAFT_MODEL)"
    )


def _tokens_by_id(tokenizer: Tokenizer) -> list[str | None]:
    vocab = tokenizer.hf.get_vocab()
    tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    return tokens
