"""SmolLM3: Llama whose every fourth layer leaves queries and keys unrotated (NoPE);
its sliding window, where ``use_sliding_window`` turns it on, is on the NoPE layers.

llama.cpp hard-codes the NoPE step (4) and permutes q and k as for Llama."""

from .family import Family, Fields, GgufKeys, HfKeys, biases

_NOPE_STEP = 4


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    layers = keys.count("num_hidden_layers")
    flags = keys.get("no_rope_layers")
    if flags is None:
        step = keys.count("no_rope_layer_interval", _NOPE_STEP)
        flags = [int((i + 1) % step != 0) for i in range(layers)]
    if not (isinstance(flags, list) and len(flags) == layers and set(flags) <= {0, 1}):
        raise keys.wrong("no_rope_layers", flags, f"{layers} flags of 0 or 1 (1: rotate)")
    fields = {**biases(keys), "rope_layers": tuple(bool(f) for f in flags)}
    if not keys.get("use_sliding_window", False):
        fields.update(sliding_window=None, layer_types=("full",) * layers)
    return fields


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    layers = fields["num_layers"]
    return {"rope_layers": tuple((i + 1) % _NOPE_STEP != 0 for i in range(layers))}


FAMILY = Family(
    name="smollm3",
    model_types=("smollm3",),
    gguf_archs=("smollm3",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_permuted_qk=True,
    # Four layers, so that llama.cpp's fixed step leaves the last one unrotated.
    # (A rope base of its own: at the default one its greedy tokens meet a near-tie.)
    tiny={
        "head_dim": 16,
        "num_hidden_layers": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
    },
)
