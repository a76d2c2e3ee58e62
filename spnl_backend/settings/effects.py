"""Settings that the other settings (or the platform) leave without effect.

A variable set on purpose but ignored costs users hours, so each one is reported by name
(``settings.no_effect``) with the reason; nothing here changes what runs.
"""

from typing import TYPE_CHECKING

from .backend_settings import KV_BUDGET_FIELDS, BackendSettings, env_name

if TYPE_CHECKING:  # the platform module reports through this one
    from .platform import PlatformDecisions

_PAGED_ONLY = ("paged_attn_block_size", *KV_BUDGET_FIELDS)
_PIC = (
    "pic_reuse",
    "pic_positions",
    "pic_recompute",
    "pic_recompute_select",
    "span_query_reuse",
    "span_template",
)
_NATIVE_ONLY = ("cpu_matmul", "cpu_gemm", "native_checks")


def given_pic_settings(settings: BackendSettings) -> list[str]:
    """The PIC settings (field names) that ``settings`` sets to other than their default:
    asking for PIC prompts, which a model with state layers refuses at load."""
    fields = BackendSettings.model_fields
    return [
        f
        for f in _PIC
        if f in settings.model_fields_set and getattr(settings, f) != fields[f].default
    ]


def ineffective_settings(
    settings: BackendSettings, decisions: "PlatformDecisions"
) -> list[tuple[str, str]]:
    """``(variable, why it has no effect)`` for each setting given that changes nothing."""
    fields = BackendSettings.model_fields
    given = {f for f in settings.model_fields_set if getattr(settings, f) != fields[f].default}
    found: list[tuple[str, str]] = []

    def report(fields: tuple[str, ...], why: str) -> None:
        found.extend((env_name(f), why) for f in fields if f in given)

    if not decisions.paged_attn:
        report(
            _PAGED_ONLY,
            f"it sizes the paged KV cache, and paged attention is off "
            f"({decisions.paged_attn_reason})",
        )
        report(
            _PIC,
            "PIC prompts run in the paged pool, and paged attention is off "
            f"({decisions.paged_attn_reason})",
        )
    elif (
        settings.kv_cache_compression != "none"
        or settings.speculative_draft_model
        or (settings.speculative_draft_isq)
    ):
        report(
            _PIC,
            "PIC prompts do not run with a compressed KV cache or a speculative draft",
        )
    elif settings.pic_reuse != "exact" and not settings.prefix_cache_enabled:
        report(
            ("pic_reuse",),
            "PIC reuses blocks through the prefix cache's keys, and prefix caching is off "
            "(MISTRALRS_PREFIX_CACHE_N)",
        )
    elif settings.prefix_cache_n > 1:
        report(
            ("prefix_cache_n",),
            "with paged attention only 0 (off) or not matters for K and V: "
            "the whole block pool caches prefixes, least recently used out first "
            "(a model with state layers keeps this many state snapshots)",
        )
    if decisions.device_type != "cpu":
        report(
            ("cpu_kernels", *_NATIVE_ONLY),
            f"it steers the CPU, and the device is {decisions.device}",
        )
    elif decisions.kernels != "cpu":
        report(
            _NATIVE_ONLY,
            f"it steers the native CPU kernels, which do not run ({decisions.kernels_reason})",
        )
    if settings.batch_invariant and decisions.kernels == "cpu":
        report(
            ("cpu_gemm",),
            "with batch invariance (MISTRALRS_BATCH_INVARIANT, on by default) every row "
            "count takes the native products; set it to false for the GEMMs",
        )
    if settings.paged_cache_type in ("f16", "f32") and settings.kv_cache_compression != "none":
        report(
            ("paged_cache_type",),
            f"the compression method {settings.kv_cache_compression!r} stores K and V "
            "in its own records",
        )
    if settings.pic_recompute == 0:
        report(
            ("pic_recompute_select",),
            "it picks the tokens recomputed, and none are (MISTRALRS_PIC_RECOMPUTE is 0)",
        )
    if settings.speculative_method == "none":
        report(
            ("speculative_gamma",),
            "no speculation is set (MISTRALRS_SPECULATIVE_METHOD=none)",
        )
    # Auto without a draft may resolve to ngram (`settings.speculation`).
    lookup = settings.speculative in ("ngram", "suffix") or (
        settings.speculative_method == "auto" and settings.speculative is None
    )
    if not lookup:
        report(
            ("speculative_ngram_min", "speculative_ngram_max"),
            "they size n-gram speculation, and MISTRALRS_SPECULATIVE_METHOD is not ngram or "
            "suffix (nor auto without a draft)",
        )
    if settings.speculative != "suffix":
        report(
            ("speculative_suffix_tokens",),
            "it bounds the suffix store, and MISTRALRS_SPECULATIVE_METHOD is not suffix",
        )
    return found
