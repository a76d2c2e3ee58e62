"""`TransformersCausalLM`: a decoder that transformers' own modeling code runs, each of its
attention layers storing K/V in the engine's cache and attending over it.

transformers calls a layer's attention through its ``AttentionInterface``, by the name in
the model's config. This module registers one function there (`ATTENTION_NAME`) that hands
the layer's q, k and v to the step's `StepAttention` (the paged pool, the contiguous
cache, an embedding pass), so the engine steps the model as it steps its own
(`models.transformer.CausalLM`): the step's sequences packed into one row of token ids and
positions, hidden states out, logits for the rows asked for. transformers builds no mask
for a name its mask interface does not know, so each layer sees only q, k, v and its
keywords; those this path does not implement (a sliding window, a softcap, sinks, dropout,
a mask) are refused by name, at load by `probe` and again at every call.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedArchitectureError
from ..kernels.attention_ref import attention_ref
from ..kernels.dispatch import KernelChoice
from ..kernels.scoring import Scoring
from .config import ModelConfig
from .step_attention import AttentionSpec, StepAttention, WithoutLayerBlocks

ATTENTION_NAME = "spnl_backend"
# The keywords a layer may pass that this path reads or that do not change the result.
_READ_KEYWORDS = frozenset({"scaling", "dropout", "is_causal", "position_ids"})
_ACTIVE = threading.local()  # the model whose forward pass runs on this thread


def register_attention() -> None:
    """Our attention function under `ATTENTION_NAME` in transformers' interface (once)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    model = getattr(_ACTIVE, "model", None)
    if model is None:
        raise RuntimeError(
            f"attention {ATTENTION_NAME!r} runs only inside a TransformersCausalLM's forward pass"
        )
    return model.attend(module, query, key, value, attention_mask, kwargs), None


def unsupported_arguments(
    module: nn.Module, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> list[str]:
    """What a layer's attention call asks beyond causal scaled-dot-product attention over
    its own sequence: each named, for the refusal."""
    found = []
    if attention_mask is not None:
        found.append("an attention mask")
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        found.append("non-causal attention")
    if kwargs.get("dropout"):
        found.append(f"dropout={kwargs['dropout']}")
    for name, value in kwargs.items():
        if name not in _READ_KEYWORDS and value is not None and value is not False:
            found.append(f"{name}={_shown(value)}")
    return found


def _shown(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


@dataclass(frozen=True)
class LayerCall:
    """One attention call seen by `TransformersCausalLM.probe`."""

    layer: int | None  # the module's ``layer_idx``
    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    scaling: float
    unsupported: tuple[str, ...]


@dataclass
class Probe:
    """What a probe pass saw: each attention call in order, whether the causal-LM head is
    the output projection of the backbone's last hidden states and nothing more, and the
    logits' width."""

    calls: list[LayerCall] = field(default_factory=list)
    head_exact: bool = False
    vocab: int = 0


class _ReferenceStep(WithoutLayerBlocks):
    """A probe's attention: one sequence, causal, no cache (the torch reference)."""

    def attend(self, q, k, v, spec: AttentionSpec) -> torch.Tensor:
        return attention_ref(q, k, v, spec.scoring, context_len=0)


@dataclass
class _Backbone:
    """What the engine reads of a model's backbone besides running it: no layer mapping, no
    native layer blocks; the input embeddings (their dtype, for an embedding pass)."""

    embed_tokens: nn.Module
    layer_spans: None = None
    layer_devices: None = None
    use_layer_blocks: bool = False

    def layer_kv(self, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise UnsupportedArchitectureError(
            "a model on transformers' modeling code has no per-layer probe (PIC is refused)"
        )


class TransformersCausalLM(nn.Module):
    """transformers' causal LM ``hf`` behind the interface of `CausalLM`: ``forward(ids,
    positions, attention)`` → hidden states ``[T, hidden]``, ``compute_logits``; one
    process, no adapters. ``config`` describes its KV layers (`ModelConfig.implementation`
    ``"transformers"``), ``specs`` each attention layer's place in the cache by its
    ``layer_idx`` (set from a `probe` by the loader)."""

    def __init__(self, hf: nn.Module, kernels: KernelChoice) -> None:
        super().__init__()
        self.hf, self.kernels = hf, kernels
        self.config: ModelConfig | None = None
        self.specs: dict[int, AttentionSpec] = {}
        self.tp = None
        self.adapters = None
        self.model = _Backbone(hf.get_input_embeddings())
        self._step: StepAttention | None = None
        self._probe: Probe | None = None

    @property
    def backbone(self) -> nn.Module:
        return getattr(self.hf, self.hf.base_model_prefix)

    @property
    def head(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: StepAttention
    ) -> torch.Tensor:
        """``input_ids``/``positions [T]`` (sequences packed) → hidden states ``[T, hidden]``."""
        with self._running(attention):
            out = self.backbone(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            )
        return _last_hidden(out)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def prepare_experts(self) -> None:
        """Nothing to stack: transformers' layers run as they are."""

    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """A layer's ``query [1, heads, T, d]``, ``key``/``value [1, kv_heads, T, d]``
        through the step's attention → ``[1, T, heads, d]``."""
        assert self._step is not None
        unsupported = unsupported_arguments(module, attention_mask, kwargs)
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
        if self._probe is not None:
            spec = self._record(module, q, k, v, float(scaling), unsupported)
        else:
            spec = self._spec(module, float(scaling), unsupported)
        return self._step.attend(q, k, v, spec)[None]

    def _spec(self, module: nn.Module, scaling: float, unsupported: list[str]) -> AttentionSpec:
        layer = getattr(module, "layer_idx", None)
        spec = self.specs.get(layer)  # type: ignore[arg-type]
        if unsupported or spec is None or spec.scoring.scale != scaling:
            why = "; ".join(unsupported) or f"layer {layer} not as probed at load"
            raise UnsupportedArchitectureError(
                f"transformers' {type(module).__name__} asked for what this path does not "
                f"run: {why}"
            )
        return spec

    def _record(self, module, q, k, v, scaling: float, unsupported: list[str]) -> AttentionSpec:
        assert self._probe is not None
        calls = self._probe.calls
        call = LayerCall(
            getattr(module, "layer_idx", None),
            q.shape[1],
            k.shape[1],
            k.shape[2],
            v.shape[2],
            scaling,
            tuple(unsupported),
        )
        calls.append(call)
        groups = max(1, call.heads // max(1, call.kv_heads))
        return AttentionSpec(len(calls) - 1, groups, Scoring(scale=scaling))

    @torch.inference_mode()
    def probe(self, input_ids: torch.Tensor) -> Probe:
        """One pass of transformers' whole causal LM over ``input_ids [T]`` on reference
        attention, recording each attention call, and whether what its head gives is the
        output projection of what the backbone gave (the split `forward` and
        `compute_logits` make)."""
        probe = self._probe = Probe()
        seen: dict[str, torch.Tensor] = {}
        hooks = [
            self.backbone.register_forward_hook(
                lambda _m, _a, out: seen.__setitem__("hidden", _last_hidden(out))
            ),
            self.head.register_forward_pre_hook(
                lambda _m, args: seen.__setitem__("head_in", args[0])
            ),
            self.head.register_forward_hook(lambda _m, _a, out: seen.__setitem__("head_out", out)),
        ]
        positions = torch.arange(len(input_ids), device=input_ids.device)
        try:
            with self._running(_ReferenceStep()):
                logits = self.hf(
                    input_ids=input_ids[None], position_ids=positions[None], use_cache=False
                ).logits
        finally:
            self._probe = None
            for hook in hooks:
                hook.remove()
        probe.vocab = logits.shape[-1]
        probe.head_exact = (
            "hidden" in seen
            and "head_in" in seen
            and torch.equal(seen["hidden"], seen["head_in"])
            and torch.equal(seen["head_out"].float(), logits.float())
        )
        return probe

    @contextmanager
    def _running(self, attention: StepAttention) -> Iterator[None]:
        """This model's attention function routed to ``attention`` for one pass (a draft
        and its target run on one thread, one after the other)."""
        previous = getattr(_ACTIVE, "model", None)
        _ACTIVE.model, self._step = self, attention
        try:
            yield
        finally:
            _ACTIVE.model, self._step = previous, None


def _last_hidden(out: Any) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
