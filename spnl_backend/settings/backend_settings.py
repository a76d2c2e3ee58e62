"""`BackendSettings`: every MISTRALRS_* variable, parsed once into a frozen object."""

import os
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ..compressors import compressor_names, plugin_failures
from ..errors import SettingsError, shown
from ..log import get_logger, set_verbose
from . import values
from .pic import RECOMPUTE_SELECTIONS, REUSE_RULES
from .values import IsqType

log = get_logger()

ENV_PREFIX = "MISTRALRS_"
KV_BUDGET_FIELDS = ("paged_attn_memory_mb", "paged_attn_memory_fraction", "paged_attn_context_len")
DEFAULT_CONTEXT_LEN = 4096
SPECULATIVE_METHODS = ("auto", "draft", "ngram", "suffix", "none")
MAX_NGRAM = 64  # the longest n-gram MISTRALRS_SPECULATIVE_NGRAM_MAX may ask for


@dataclass(frozen=True)
class KvBudget:
    """How the paged KV cache is sized: one of the three budget variables."""

    kind: Literal["memory_mb", "memory_fraction", "context_len"]
    value: float
    explicit: bool


def _parse_compression(value: object) -> str:
    name = str(value).strip().lower()
    if name not in compressor_names():
        failed = "".join(
            f"; plugin {n!r} failed to load ({why})" for n, why in plugin_failures().items()
        )
        raise ValueError(
            "expected one of the registered compressors: " + ", ".join(compressor_names()) + failed
        )
    return name


_PARSERS = {
    "paged_attn": values.parse_paged_attn,
    "paged_attn_block_size": values.parse_block_size,
    "prefix_cache_n": values.parse_prefix_cache_n,
    "isq": values.parse_isq,
    "paged_attn_memory_mb": values.parse_positive_int,
    "paged_attn_memory_fraction": values.parse_fraction,
    "paged_attn_context_len": values.parse_positive_int,
    "paged_cache_type": values.parse_cache_type,
    "speculative_draft_model": values.parse_optional_name,
    "speculative_gamma": values.parse_positive_int,
    "speculative_draft_isq": values.parse_isq,
    "speculative_method": values.choice(SPECULATIVE_METHODS),
    "speculative_ngram_min": values.parse_positive_int,
    "speculative_ngram_max": values.parse_positive_int,
    "speculative_suffix_tokens": values.parse_positive_int,
    "kv_cache_compression": _parse_compression,
    "cpu_kernels": values.choice(values.CPU_KERNELS),
    "cpu_matmul": values.choice(values.CPU_MATMULS),
    "cpu_gemm": values.choice(values.CPU_GEMMS),
    "batch_invariant": values.parse_bool,
    "num_threads": values.parse_num_threads,
    "pic_reuse": values.choice(REUSE_RULES),
    "span_query_reuse": values.choice(REUSE_RULES),
    "pic_positions": values.choice(("after_prefix", "local", "sequential")),
    "pic_recompute": values.parse_share,
    "pic_recompute_select": values.choice(RECOMPUTE_SELECTIONS),
    "span_template": values.choice(("model", "spnl")),
    "native_checks": values.parse_bool,
    "token_healing": values.parse_bool,
    "no_nccl": values.parse_bool,
    "mn_global_world_size": values.parse_positive_int,
    "mn_local_world_size": values.parse_positive_int,
    "mn_head_num_workers": values.parse_count,
    "mn_head_port": values.parse_port,
    "mn_worker_server_addr": values.parse_host_port,
    "mn_worker_id": values.parse_count,
    "collective_timeout_s": values.parse_seconds,
    "device_layers": values.parse_device_layers,
    "model": values.parse_optional_name,
    "model_impl": values.choice(values.MODEL_IMPLS),
    "device": values.parse_device,
    "dtype": values.parse_dtype,
    "verbose": values.parse_bool,
    "kv_tier_dir": values.parse_directory,
    "kv_tier_mb": values.parse_positive_int,
    "chat_template": values.parse_chat_template,
    "reasoning_format": values.parse_reasoning_format,
    "lora_adapters": values.parse_lora_adapters,
    "lora_max_loaded": values.parse_count,
    "default_chat_template_kwargs": values.parse_template_kwargs,
}


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


class BackendSettings(BaseSettings):
    """The resolved, validated configuration of a backend.

    Read from the environment (``MISTRALRS_<FIELD>``) or built in code with the
    same names in lower case; both go through the same parsers, and a bad value
    raises `SettingsError` naming the variable, the value and what is accepted.
    An empty variable counts as unset.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,
        frozen=True,
        extra="forbid",
        protected_namespaces=(),
    )

    paged_attn: bool | Literal["auto"] = "auto"
    paged_attn_block_size: int = 32
    prefix_cache_n: int = 16
    isq: IsqType | None = None
    paged_attn_memory_mb: int | None = None
    paged_attn_memory_fraction: float | None = None
    paged_attn_context_len: int | None = None
    # How K and V are stored: auto is float16 where the native CPU kernels attend (half the
    # bytes, read back exactly and computed in float32), else the model's dtype.
    paged_cache_type: Literal["auto", "f8e4m3", "f16", "f32"] = "auto"
    speculative_draft_model: str | None = None
    # bench/speculative.py: where a draft pays at all, 16 drafts per step paid best.
    speculative_gamma: int = 16
    speculative_draft_isq: IsqType | None = None
    # What proposes the tokens the target verifies: a draft model (the two settings above),
    # n-gram lookup in each sequence's own prompt and output (`engine.ngram`, no draft), or
    # nothing; auto is the draft where one is set, else ngram where speculation can run,
    # else nothing (`settings.speculation`, measured there); suffix is n-gram lookup
    # that falls back on a store shared by the requests (`engine.suffix`: prompts' documents
    # and finished outputs, copies within a token budget). The n-gram sizes looked up, the
    # longest first.
    speculative_method: Literal["auto", "draft", "ngram", "suffix", "none"] = "auto"
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    # The suffix store's budget in tokens (its index holds an entry per n-gram size each).
    speculative_suffix_tokens: int = 65536
    kv_cache_compression: str = "none"
    # How the CPU computes (`info` shows what auto picked): the compiled C kernels or the
    # torch twins; int8 or float32 activations in the quantized products; and, only where
    # batch invariance is off, float32 or bfloat16 GEMMs for products of many rows.
    cpu_kernels: Literal["auto", "native", "torch"] = "auto"
    cpu_matmul: Literal["auto", "int8", "float32"] = "auto"
    cpu_gemm: Literal["auto", "float32", "bfloat16"] = "auto"
    # A request's tokens the same whatever shares its step: every row count and query length
    # takes the same arithmetic. Off, many-row steps may take faster paths (a GEMM of
    # dequantized weights, torch attention for long queries) whose rounding depends on them.
    batch_invariant: bool = True
    # The CPU threads the kernels compute on (one pool for the process's native kernels;
    # the engine's own torch operations run on its thread alone): auto sizes it to the
    # CPUs the process may use (affinity, cgroup quota), or OMP_NUM_THREADS where set.
    num_threads: int | Literal["auto"] = "auto"
    # Position-independent caching of plus blocks (`pic`): exact reuses an element's K/V
    # only after the same tokens (bit for bit a recompute); relaxed after any at the same
    # position; tokens (spnl's rule) after any, wherever it stands (approximate). spnl's
    # span queries (/v1/query/execute) follow their own rule, spnl's by default. How
    # elements' positions are numbered: `pic.layout`; how a span query's (or a plus
    # chat message's) messages are templated, each alone: `pic.turns`.
    pic_reuse: Literal["exact", "relaxed", "tokens"] = "exact"
    span_query_reuse: Literal["exact", "relaxed", "tokens"] = "tokens"
    pic_positions: Literal["after_prefix", "local", "sequential"] = "after_prefix"
    # The fraction of each plus element's first tokens computed again with full attention
    # (over everything before them) where it is reused or computed (`pic.layout`).
    pic_recompute: float = 0.0
    # Which of an element's tokens those are: its first ones, or (CacheBlend's rule) the
    # group's tokens whose layer-1 K/V deviate most from a full-attention pass of layer 0.
    pic_recompute_select: Literal["first", "deviation"] = "first"
    span_template: Literal["model", "spnl"] = "model"
    # Debugging: the C kernels compiled with a check of every index they follow.
    native_checks: bool = False
    # Token healing for completions whose request does not say (`constrain.healing`).
    token_healing: bool = False
    # Beyond one device (`settings.topology`), with mistral.rs's meanings: no tensor
    # parallelism; the ranks of every node and of this one; the head node's worker count
    # and port; a worker node's head address and its id.
    no_nccl: bool = False
    mn_global_world_size: int | None = None
    mn_local_world_size: int | None = None
    mn_head_num_workers: int | None = None
    mn_head_port: int | None = None
    mn_worker_server_addr: str | None = None
    mn_worker_id: int | None = None
    # How long a rank waits for the others in one collective before it gives them up.
    collective_timeout_s: float = 60.0
    # Layer mapping (`settings.topology.LayerMap`): consecutive layers on each device.
    device_layers: Annotated[tuple[tuple[int, int], ...] | None, NoDecode] = None
    model: str | None = None
    # Whose code runs a safetensors model: auto is ours where the model type has a family
    # module (`models.arch`), else transformers' own modeling code over our paged KV cache
    # (`loader.transformers_path`); native refuses a type without a module; transformers
    # takes transformers' code for every safetensors model.
    model_impl: Literal["auto", "native", "transformers"] = "auto"
    device: str = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    verbose: bool = False
    # The KV tier (`engine.kv_tier`): the pool's registered blocks also kept on disk in this
    # directory, read back where the pool misses (after an eviction, a restart, or by
    # another process on the same directory), within a byte budget; off where unset.
    kv_tier_dir: str | None = None
    kv_tier_mb: int = 8192
    # The chat template used instead of the model's own: a file's path or the Jinja
    # source itself; one that does not compile fails the load, naming its line.
    chat_template: str | None = None
    # How reasoning is told from the answer (`reasoning.formats`): auto reads it from the
    # chat template; none leaves the whole output the answer.
    reasoning_format: Literal["auto", "none", "think", "granite", "harmony"] = "auto"
    # LoRA adapters on the base model, ``name=path,name2=path2`` (PEFT directories): a
    # request names one (``adapter=``, or the server's ``model``) or runs the base.
    lora_adapters: str | None = None
    # The most LoRA adapters held in memory at once (0: no bound): beyond it the least
    # recently used idle one is evicted, and read again when a request asks for it.
    lora_max_loaded: int = 0
    # Chat template variables every chat gets (a JSON object), under each request's own
    # (``chat_template_kwargs``, ``reasoning_effort``...), which win where both name one.
    default_chat_template_kwargs: str | None = None

    def __init__(self, **kwargs: Any) -> None:
        try:
            super().__init__(**kwargs)
        except ValidationError as exc:
            raise SettingsError(_describe(exc, given_in_code=set(kwargs))) from None

    @field_validator("*", mode="before")
    @classmethod
    def _parse(cls, value: object, info: ValidationInfo) -> object:
        if value is None and cls.model_fields[info.field_name].default is None:
            return None
        try:
            return _PARSERS[info.field_name](value)
        except ValueError:
            raise
        except Exception as exc:  # a value whose str() or float() raises, an int too large
            raise ValueError(f"cannot be read as a value ({type(exc).__name__})") from None

    @model_validator(mode="after")
    def _one_kv_budget(self) -> "BackendSettings":
        chosen = [f for f in KV_BUDGET_FIELDS if getattr(self, f) is not None]
        if len(chosen) > 1:
            raise ValueError(
                "at most one KV-cache budget may be set, but "
                + " and ".join(f"{env_name(f)}={getattr(self, f)}" for f in chosen)
                + " are; keep one of "
                + ", ".join(env_name(f) for f in KV_BUDGET_FIELDS)
            )
        return self

    @model_validator(mode="after")
    def _whole_blocks(self) -> "BackendSettings":
        """A context length the cache would have to round is refused, not changed."""
        tokens, block = self.paged_attn_context_len, self.paged_attn_block_size
        if tokens is not None and tokens % block:
            below, above = tokens // block * block, (tokens // block + 1) * block
            suggestion = f"{below} or {above}" if below else f"{above}"
            raise ValueError(
                f"{env_name('paged_attn_context_len')}={tokens} is not a whole number of KV "
                f"blocks of {env_name('paged_attn_block_size')}={block} tokens (the cache "
                f"is made of whole blocks); use {suggestion}"
            )
        return self

    @model_validator(mode="after")
    def _one_kv_compression(self) -> "BackendSettings":
        if self.paged_cache_type == "f8e4m3" and self.kv_cache_compression != "none":
            raise ValueError(
                f"{env_name('paged_cache_type')}=f8e4m3 and "
                f"{env_name('kv_cache_compression')}={self.kv_cache_compression} both "
                "compress the KV cache; set one of them (the fp8 method is the same FP8 "
                "cache through the protocol)"
            )
        return self

    @model_validator(mode="after")
    def _one_speculative_method(self) -> "BackendSettings":
        method = env_name("speculative_method")
        draft = [
            f"{env_name(f)}={getattr(self, f)}"
            for f in ("speculative_draft_model", "speculative_draft_isq")
            if getattr(self, f) is not None
        ]
        if self.speculative_method == "draft" and not draft:
            raise ValueError(
                f"{method}=draft needs a draft: set {env_name('speculative_draft_model')} "
                f"or {env_name('speculative_draft_isq')}"
            )
        if self.speculative_method in ("ngram", "suffix", "none") and draft:
            raise ValueError(
                f"{method}={self.speculative_method} uses no draft model, but a draft is "
                f"set ({', '.join(draft)}); unset it, or set {method}=draft (or auto)"
            )
        low, high = self.speculative_ngram_min, self.speculative_ngram_max
        if not low <= high <= MAX_NGRAM:
            raise ValueError(
                f"{env_name('speculative_ngram_min')}={low} and "
                f"{env_name('speculative_ngram_max')}={high}: expected "
                f"1 <= min <= max <= {MAX_NGRAM}"
            )
        return self

    @property
    def speculative(self) -> Literal["draft", "ngram", "suffix"] | None:
        """What proposes tokens for the target to verify, as the settings alone say: the
        method set, or the draft where one is set, else None. Auto without a draft is None
        here; the engine resolves it (`settings.speculation.choose_speculation`) once it
        knows the model and its cache, and `Engine.speculation` says what runs."""
        if self.speculative_method in ("ngram", "suffix"):
            return self.speculative_method
        if self.speculative_draft_model is not None or self.speculative_draft_isq is not None:
            return "draft"
        return None

    @property
    def kv_budget(self) -> KvBudget:
        for field in KV_BUDGET_FIELDS:
            value = getattr(self, field)
            if value is not None:
                kind = field.removeprefix("paged_attn_")
                return KvBudget(kind=kind, value=value, explicit=True)  # type: ignore[arg-type]
        return KvBudget(kind="context_len", value=DEFAULT_CONTEXT_LEN, explicit=False)

    @property
    def prefix_cache_enabled(self) -> bool:
        return self.prefix_cache_n > 0

    @classmethod
    def sources(cls) -> dict[str, str]:
        """For each field, whether the environment sets it (``env``) or not (``default``)."""
        return {
            name: "env" if os.environ.get(env_name(name), "").strip() else "default"
            for name in cls.model_fields
        }


def unknown_env_variables() -> list[str]:
    """MISTRALRS_* variables that match no setting (typos are reported, not ignored)."""
    known = {env_name(f) for f in BackendSettings.model_fields}
    return sorted(
        k for k in os.environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known
    )


def _describe(exc: ValidationError, given_in_code: set[str]) -> str:
    problems = []
    for error in exc.errors(include_url=False):
        field = str(error["loc"][0]) if error["loc"] else None
        reason = str(error.get("ctx", {}).get("error", error["msg"]))
        if field is None:
            problems.append(reason)
        elif error["type"] == "extra_forbidden":
            problems.append(
                f"unknown setting {field!r}; known settings: "
                + ", ".join(BackendSettings.model_fields)
            )
        elif field in given_in_code:
            value = shown(error["input"])
            problems.append(f"{field}={value} ({env_name(field)}) is invalid: {reason}")
        else:
            problems.append(f"{env_name(field)}={shown(error['input'])} is invalid: {reason}")
    return "; ".join(problems)


def load_settings(**overrides: Any) -> BackendSettings:
    """Read the environment (plus any overrides given in code), log the result.

    Applies ``MISTRALRS_VERBOSE`` to the library's logging and reports
    MISTRALRS_* variables that match no setting.
    """
    settings = BackendSettings(**overrides)
    set_verbose(settings.verbose)
    for name in unknown_env_variables():
        log.warning(
            "settings.unknown_variable",
            variable=name,
            hint="not a setting of spnl-backend; check the spelling",
        )
    log.info(
        "settings.resolved",
        **{
            k: v
            for k, v in settings.model_dump().items()
            if v != BackendSettings.model_fields[k].default
        },
    )
    return settings
