"""A model split over the ranks of a tensor-parallel group: each rank's share of the
config, and each weight's rows or columns as the weights stream in from the file (as the
loader takes them: `RankSplit`, a `loader.model.ModelSplit`).

Attention heads split across the ranks (key/value heads too, or each rank holds the one
its query heads read where there are fewer key/value heads than ranks): q, k and v are
split by rows (column-parallel), o by columns (row-parallel, its output summed over the
ranks). The MLP's gate and up (each expert's and a shared expert's too) by rows, down by
columns. The embedding and the LM head by vocabulary rows. Norms (but q and k norms whose
weight spans the heads: OLMoE's, Cohere's), the router, a shared expert's gate and the
rotary tables are whole on every rank. Quantized weights split along whole GGML blocks
and are never dequantized: a row split takes whole rows, a column split whole blocks of
every row. A LoRA adapter's matrices are cut as the projection they attach to
(`Shard.lora_share`).
"""

import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import cast

import torch

from ..errors import SettingsError
from ..kernels.lora_ref import LoraPair
from ..models.collectives import shard_range
from ..models.config import ModelConfig
from ..quant.ggml import ggml_format
from ..quant.linear import QuantizedWeight
from .tensor_parallel import TensorParallel

Weight = torch.Tensor | QuantizedWeight
NamedWeights = Iterator[tuple[str, Weight]]

_LAYER = r"model\.layers\.\d+\."
_EXPERT = r"mlp\.experts\.\d+\."
# a layer's MLP: dense, a routed expert, or the shared expert (whose one-row gate, outside
# it, every rank keeps whole: it scales each rank's share alike)
_MLP = rf"(?:{_EXPERT}|mlp\.|shared_mlp\.)"
_BY_ROWS = re.compile(
    _LAYER + rf"(self_attn\.(?P<qkv>[qkv])_proj|{_MLP}(gate|up)_proj)\.(weight|bias)"
)
_BY_COLUMNS = re.compile(_LAYER + rf"(self_attn\.o_proj|{_MLP}down_proj)\.weight")
_O_BIAS = re.compile(_LAYER + rf"(self_attn\.o_proj|{_MLP}down_proj)\.bias")
_SINKS = re.compile(_LAYER + r"self_attn\.sinks")  # one per query head
_FULL_NORM = re.compile(_LAYER + r"self_attn\.(?P<which>[qk])_norm\.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias")


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world``'s share of a model described by ``config``."""

    config: ModelConfig
    rank: int
    world: int

    @property
    def kv_heads(self) -> int:
        """Key/value heads this rank holds."""
        return max(1, self.config.num_kv_heads // self.world)

    @property
    def kv_replicas(self) -> int:
        """Ranks that hold each key/value head."""
        return self.kv_heads * self.world // self.config.num_kv_heads

    def local_config(self) -> ModelConfig:
        """This rank's model: its heads, its rows of every MLP (the vocabulary's split is
        the model's own: `models.collectives.shard_range`)."""
        c, world = self.config, self.world
        moe = c.moe
        if moe is not None:
            shared = moe.shared_intermediate_size
            moe = dataclasses.replace(
                moe,
                intermediate_size=moe.intermediate_size // world,
                shared_intermediate_size=None if shared is None else shared // world,
            )
        return dataclasses.replace(
            c,
            num_heads=c.num_heads // world,
            num_kv_heads=self.kv_heads,
            intermediate_size=c.intermediate_size // world,
            moe=moe,
        )

    def weights(self, weights: NamedWeights) -> NamedWeights:
        """Each weight of the stream cut to this rank's share, as it streams past."""
        for name, weight in weights:
            yield name, self.cut(name, weight)

    def cut(self, name: str, weight: Weight) -> Weight:
        if name in _VOCAB:
            return _rows(weight, *shard_range(weight.shape[0], self.rank, self.world))
        if match := _BY_ROWS.fullmatch(name):
            which = match["qkv"]
            if which in ("k", "v"):
                return _rows(weight, *self._kv_rows())
            return _rows(weight, *_even(weight.shape[0], self.rank, self.world))
        if _BY_COLUMNS.fullmatch(name):
            return _columns(weight, *_even(weight.shape[1], self.rank, self.world), name)
        if _SINKS.fullmatch(name):
            return weight[slice(*_even(weight.shape[0], self.rank, self.world))]
        if _O_BIAS.fullmatch(name):  # added once: by the first rank
            return weight if self.rank == 0 else torch.zeros_like(weight)
        if _split_norms(self.config) and (match := _FULL_NORM.fullmatch(name)):
            # OLMoE's over the whole projection, or Cohere's a row per head: this rank's
            if match["which"] == "k":
                start, end = self._kv_rows()
                if weight.dim() == 2:  # rows of heads
                    start, end = start // self.config.head_dim, end // self.config.head_dim
                return weight[start:end]
            return weight[slice(*_even(weight.shape[0], self.rank, self.world))]
        return weight

    def lora_share(self, module: str, pair: LoraPair) -> LoraPair:
        """An adapter's matrices for projection ``module``, cut as its weight is: a
        column-parallel projection's lora_B by its output rows (lora_A whole), a
        row-parallel one's lora_A by its input columns (lora_B whole). A row-parallel
        rank's ``x_r A_r^T B^T`` is then its part of the whole product, added to its part
        of the base product and summed with it by the same all-reduce. A projection every
        rank holds whole keeps the adapter whole."""
        weight = f"{module}.weight"
        if _BY_ROWS.fullmatch(weight):
            return LoraPair(pair.a, _copied(self.cut(weight, pair.b)), pair.scale)
        if _BY_COLUMNS.fullmatch(weight):
            return LoraPair(_copied(self.cut(weight, pair.a)), pair.b, pair.scale)
        return pair

    def whole_features(self, module: str, in_features: int, out_features: int) -> tuple[int, int]:
        """The whole model's (in, out) of projection ``module``, whose share has these."""
        weight = f"{module}.weight"
        if match := _BY_ROWS.fullmatch(weight):
            if match["qkv"] in ("k", "v"):  # ranks may share heads: not share * world
                return in_features, self.config.num_kv_heads * self.config.head_dim
            return in_features, out_features * self.world
        if _BY_COLUMNS.fullmatch(weight):
            return in_features * self.world, out_features
        return in_features, out_features

    def _kv_rows(self) -> tuple[int, int]:
        c, dim = self.config, self.config.head_dim
        if c.num_kv_heads >= self.world:
            first = self.rank * self.kv_heads
        else:  # several ranks share each head: the one their query heads read
            first = self.rank * c.num_kv_heads // self.world
        return first * dim, (first + self.kv_heads) * dim


def check_shardable(
    config: ModelConfig, world: int, split_block: Callable[[str], int] = lambda _: 1
) -> None:
    """That ``config`` splits ``world`` ways, before any weight loads: heads, key/value
    heads, the MLPs' rows, and the columns of the weights split by columns into whole
    blocks of their stored type (``split_block(kind)``: the block size of the "o" or
    "down" weights as stored, 1 for float)."""
    c = config
    problems = []
    if c.num_state_layers:
        problems.append(
            f"its {c.num_state_layers} state layers (Gated DeltaNet, Mamba-2, Mamba-1) are not "
            "split yet"
        )
    if c.mla is not None:
        problems.append("its multi-head latent attention (DeepSeek) is not split yet")
    elif not c.uniform_kv or c.per_layer_input_size:
        problems.append(
            "its KV layers of several shapes, shared K/V and per-layer embeddings (Gemma 4) "
            "are not split yet"
        )
    if c.num_heads % world:
        problems.append(f"its {c.num_heads} attention heads do not divide by {world}")
    if c.num_kv_heads % world and world % c.num_kv_heads:
        problems.append(
            f"its {c.num_kv_heads} key/value heads neither divide by {world} nor divide it"
        )
    inners = [("MLP", c.intermediate_size)]
    if c.moe is not None:
        inners.append(("experts' MLP", c.moe.intermediate_size))
    if c.moe is not None and c.moe.shared_intermediate_size:
        inners.append(("shared expert's MLP", c.moe.shared_intermediate_size))
    for what, rows in inners:
        if rows % world:
            problems.append(f"its {what} of {rows} rows does not divide by {world}")
    columns = [("o", c.num_heads * c.head_dim), ("down", c.intermediate_size)]
    if c.moe is not None:  # the experts' downs, and any dense layers' beside them
        columns.append(("down", c.moe.intermediate_size))
    if c.moe is not None and c.moe.shared_intermediate_size:
        columns.append(("down", c.moe.shared_intermediate_size))
    for kind, width in columns:
        block = split_block(kind)
        if block > 1 and not problems and (width // world) % block:
            problems.append(
                f"its {kind} projection's {width} columns split {world} ways give "
                f"{width // world}, not a whole number of its stored blocks of {block}"
            )
    if problems:
        raise SettingsError(
            f"this {c.architecture} model cannot be split over {world} ranks: "
            + "; ".join(problems)
            + "; choose a world size that divides them (or one rank)"
        )


def _split_norms(config: ModelConfig) -> bool:
    """Whether q and k norm weights are split with the heads: over the whole projections
    (OLMoE), or per head with a row each (Cohere's LayerNorms); a per-head RMSNorm's one
    row is every rank's."""
    return config.qk_norm_full or (config.qk_norm and config.norm_kind != "rms")


def _even(size: int, rank: int, world: int) -> tuple[int, int]:
    share = size // world
    return rank * share, (rank + 1) * share


def _copied(tensor: Weight) -> torch.Tensor:
    """A share of a float matrix in memory of its own (a view would keep the whole)."""
    return cast(torch.Tensor, tensor).clone(memory_format=torch.contiguous_format)


def _rows(weight: Weight, start: int, end: int) -> Weight:
    if isinstance(weight, QuantizedWeight):
        return weight.rows(slice(start, end))
    return weight[start:end]


def _columns(weight: Weight, start: int, end: int, name: str) -> Weight:
    if not isinstance(weight, QuantizedWeight):
        return weight[:, start:end]
    fmt = ggml_format(weight.qtype)
    block, nbytes = fmt.block_size, fmt.type_size
    if start % block or end % block:  # check_shardable refuses such models first
        raise SettingsError(f"{name}: columns {start}:{end} cut {weight.qtype.name} blocks")
    data = weight.data[:, start // block * nbytes : end // block * nbytes]
    return QuantizedWeight(data.contiguous(), weight.qtype, (weight.shape[0], end - start))


class RankSplit:
    """How this rank takes its share: the model's config cut to its heads and rows, each
    weight cut as it streams in, and the group its layers sum over."""

    def __init__(self, tp: TensorParallel) -> None:
        self.collectives = tp

    def local_config(self, config: ModelConfig) -> ModelConfig:
        shard = Shard(config, self.collectives.rank, self.collectives.world)
        self.collectives.kv_replicas = shard.kv_replicas
        self.collectives.shard = shard  # what cuts LoRA adapters later, as the weights
        return shard.local_config()

    def weights(self, config: ModelConfig, weights: NamedWeights) -> NamedWeights:
        return Shard(config, self.collectives.rank, self.collectives.world).weights(weights)
