"""Each dense family's tiny model whose GGUF twin the tests' writer makes
(`tiny_models.write_gguf`), converted by llama.cpp's own converter
(``convert_hf_to_gguf.py``) instead, loaded here and compared with transformers: the
writer checked against the real thing. The tiny byte-level vocabulary matches none of the
converter's known pre-tokenizers, so the converter runs with its vocabulary step replaced
by its plain BPE one (the model's tensors and keys are converted as they always are)."""

import pytest
import torch
from helpers import CPU, PROMPT, model_logits
from llama_cpp_converter import convert_one
from tiny_models import WRITER_CHECKED, build_hf_model

from spnl_backend import load_backend


@pytest.mark.slow
@pytest.mark.parametrize("arch", WRITER_CHECKED)
def test_the_converters_gguf_has_transformers_logits(tmp_path, arch):
    tiny = build_hf_model(arch, tmp_path / "hf")
    path = convert_one(tiny.path, tmp_path / "model.gguf", "f32", pre="plain-bpe")
    ids = tiny.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        expected = tiny.hf(torch.tensor([ids])).logits[0]
    with load_backend(str(path), settings=CPU) as backend:
        torch.testing.assert_close(model_logits(backend, ids), expected, atol=1e-4, rtol=1e-4)
