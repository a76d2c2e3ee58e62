"""Each dense family's tiny model converted by llama.cpp's own converter
(``convert_hf_to_gguf.py``), loaded here and compared with transformers: what the tests'
GGUF writer (`tiny_models.write_gguf`) mirrors, checked against the real thing.

Opt-in: the converter is not a dependency. Set ``SPNL_LLAMA_CPP_DIR`` to a llama.cpp
source tree (its ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``); without it
these tests are skipped. The tiny byte-level vocabulary matches none of the converter's
known pre-tokenizers, so the converter is run with its vocabulary step replaced by its
plain BPE one (the model's tensors and keys are converted as they always are)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CPU, PROMPT, model_logits
from tiny_models import ARCHITECTURES, CONVERTIBLE, build_hf_model

from spnl_backend import load_backend

LLAMA_CPP = os.environ.get("SPNL_LLAMA_CPP_DIR")
pytestmark = pytest.mark.skipif(not LLAMA_CPP, reason="SPNL_LLAMA_CPP_DIR is not set")

# The converter, its vocabulary step replaced by the plain BPE one for the tiny tokenizer.
_RUNNER = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
import conversion, conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
found = conversion.get_model_class
def plain_vocab(name, mmproj=False):
    cls = found(name, mmproj)
    cls.set_vocab = lambda self: self._set_vocab_gpt2()
    return cls
conversion.get_model_class = plain_vocab
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""
# Dense families whose tiny model the converter takes as it is. Left out: phi3 (its
# LongRoPE tiny model's short original context trips the converter's checks), gemma3 (its
# tiny model keeps the attn_logit_softcapping the converter asserts absent), mistral (a
# llama file carries no sliding window: the windowed tiny model converts to another model).
CONVERTED = tuple(a for a in ARCHITECTURES if a in CONVERTIBLE and a not in ("gemma3", "mistral"))


def _convert(model_dir: Path, out: Path) -> Path:
    command = [sys.executable, "-c", _RUNNER, LLAMA_CPP, str(model_dir)]
    command += ["--outfile", str(out), "--outtype", "f32"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("arch", CONVERTED)
def test_the_converters_gguf_has_transformers_logits(tmp_path, arch):
    tiny = build_hf_model(arch, tmp_path / "hf")
    path = _convert(tiny.path, tmp_path / "model.gguf")
    ids = tiny.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        expected = tiny.hf(torch.tensor([ids])).logits[0]
    with load_backend(str(path), settings=CPU) as backend:
        torch.testing.assert_close(model_logits(backend, ids), expected, atol=1e-4, rtol=1e-4)
