"""Gemma 2: Gemma 3's sandwich norms and scaled embedding without its q/k norms, with
softcapped attention logits and final logits, sliding and global layers alternating
(one rope for both).

llama.cpp hard-codes the alternation (every second layer global), a 4,096-token window
where the file names none, and the 27B's query scale (hidden / heads).
"""

from .family import SANDWICH_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys
from .gemma3 import GEMMA_CHAT_TEMPLATE, gemma_fields, gemma_gguf_fields

_SWA_PATTERN = 2
_WINDOW = 4096
_27B_LAYERS = 46


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {**gemma_fields(keys), "attn_softcap": keys.positive("attn_logit_softcapping", None)}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    return {
        **gemma_gguf_fields(keys, fields, _SWA_PATTERN, _27B_LAYERS),
        "sliding_window": fields["sliding_window"] or _WINDOW,
        "attn_softcap": keys.positive("attn_logit_softcapping", None),
    }


FAMILY = Family(
    name="gemma2",
    model_types=("gemma2",),
    gguf_archs=("gemma2",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names=SANDWICH_GGUF_NAMES,
    gguf_auto_tokenizer=True,
    chat_template=GEMMA_CHAT_TEMPLATE,
    tiny={
        "tie_word_embeddings": True,
        "head_dim": 16,
        "sliding_window": 8,
        "query_pre_attn_scalar": 16,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 5.0,  # small, so the cap bends the tiny model's scores
    },
)
