"""docs/coverage.md, generated from the family registry: each family's model types and
GGUF architectures, the mechanisms its tiny model's layer descriptions hold, and how the
tests check it. `tests/test_coverage_table.py` fails when the page is stale;
``python tests/coverage_table.py`` writes it again."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import (
    CONVERTED,
    GGUF_CONVERTER_TESTS,
    WRITER_CHECKED,
    build_tokenizer,
    hf_config,
)

from spnl_backend.loader.hf_config import model_config_from_hf
from spnl_backend.models.arch import FAMILIES
from spnl_backend.models.arch.family import Family
from spnl_backend.models.config import ModelConfig
from spnl_backend.models.layers import AttentionMixer, DenseFFN, MoeFFN

PAGE = Path(__file__).parent.parent / "docs" / "coverage.md"

_HEAD = """# Model coverage

Generated from the family registry (`spnl_backend/models/arch/`) by
`python tests/coverage_table.py`; `tests/test_coverage_table.py` fails when it is stale.
Each row is one family module. *Mechanisms* are those its tiny test model's layer
descriptions hold (a real checkpoint of the family may use fewer). Every family is
checked against transformers (logits and greedy tokens) from safetensors, and from a
GGUF: written by llama.cpp's own `convert_hf_to_gguf.py` where the table says
*converter*, else by the tests' writer with the names and keys that converter writes
(and for most, that writer's file checked once against the converter's).
A `model_type` with no module here runs on transformers' own modeling code where it can
be run exactly ([Models](models.md#models-without-a-family-module-transformers-code)).

| family | `model_type` | GGUF `general.architecture` | mechanisms | GGUF tested from |
|---|---|---|---|---|
"""


def _attention(mixer: AttentionMixer) -> list[str]:
    found = ["latent attention (MLA)" if mixer.latent is not None else "attention"]
    scoring = mixer.spec.scoring
    found += [
        name
        for name, present in (
            ("sliding window", scoring.window is not None),
            ("chunked attention", scoring.chunk is not None),
            ("softcap", scoring.softcap is not None),
            ("sinks", mixer.sinks),
            ("no rope", mixer.rope is None),
            ("q/k norm", mixer.qk_norm is not None),
            ("qkv bias", mixer.qkv_bias),
            ("output gate", mixer.output_gate),
            ("query temperature", mixer.temperature is not None),
        )
        if present
    ]
    return found


def mechanisms(config: ModelConfig) -> list[str]:
    """What the layers of ``config`` hold, in a fixed order, each named once."""
    found: list[str] = []
    for spec in config.layers:
        if spec.attention is not None:
            found += _attention(spec.attention)
        if spec.state_mixer is not None:
            found.append(type(spec.state_mixer).__name__.removesuffix("Mixer"))
        if spec.attention is not None and spec.state_mixer is not None:
            found.append("attention beside a state layer")
        if isinstance(spec.ffn, MoeFFN):
            found.append("experts")
            if spec.ffn.moe.shared_intermediate_size:
                found.append("shared expert")
        elif isinstance(spec.ffn, DenseFFN):
            found.append("gated MLP" if spec.ffn.gated else "plain MLP")
        found.append(f"{spec.norm} norms, {spec.norms}")
        if spec.per_layer_input:
            found.append("per-layer inputs")
    if config.rope.rotary_dim and config.rope.rotary_dim < config.head_dim:
        found.append("partial rotary")
    if len(set(config.kv_shapes)) > 1 or not config.uniform_kv:
        found.append("KV groups")
    return list(dict.fromkeys(found))


def _row(found: Family, vocab: int) -> str:
    config = model_config_from_hf(hf_config(found.name, vocab))
    if found.name in CONVERTED or found.name in GGUF_CONVERTER_TESTS:
        gguf = "converter"
    else:
        gguf = "tests' writer" if found.gguf_archs else "(no architecture of its own)"
        if found.name in WRITER_CHECKED:
            gguf += ", checked against the converter's"
    cells = (
        found.name,
        ", ".join(f"`{t}`" for t in (*found.model_types, *found.wrapper_types)),
        ", ".join(f"`{a}`" for a in found.gguf_archs) or "—",
        "; ".join(mechanisms(config)),
        gguf,
    )
    return "| " + " | ".join(cells) + " |\n"


def table() -> str:
    vocab = len(build_tokenizer())
    return _HEAD + "".join(_row(f, vocab) for f in FAMILIES)


if __name__ == "__main__":
    PAGE.write_text(table())
    print(f"wrote {PAGE}")
