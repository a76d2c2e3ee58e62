"""ERNIE 4.5 (dense): Llama whose rope turns adjacent pairs of each head (GPT-J's
interleaved order, llama.cpp's NORM kind), in both formats: its q and k rows are put in
rotate-half order as they load (`family.rotate_pairs_as_halves`). Its ``use_bias`` puts
biases on every projection, the MLP's included, which no layer here has: refused (in a
GGUF, the loader refuses their tensors by name)."""

from .family import Family, Fields, HfKeys, rotate_pairs_as_halves


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    if keys.get("use_bias", False):
        raise keys.wrong("use_bias", True, "false (biased MLP projections are not supported)")
    return {}


FAMILY = Family(
    name="ernie4_5",
    model_types=("ernie4_5",),
    gguf_archs=("ernie4_5",),
    hf_fields=_hf,
    tensors=rotate_pairs_as_halves,
    tiny={"head_dim": 16, "tie_word_embeddings": True},
)
