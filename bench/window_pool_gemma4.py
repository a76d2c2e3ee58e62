"""The KV pool's bytes for the tiny Gemma 4 (`tests/tiny_models.py`: two sliding layers
of 2 KV heads x 16, window 8, one global layer of 1 x 32; two shared layers that store
nothing) at a long context, the sliding layers' own pool on or off.

    PYTHONPATH=.:tests python bench/window_pool_gemma4.py [--context 32768]

Prints, for each, the context's tokens, the windowed pool's blocks and the pool's bytes.
"""

import argparse
import tempfile
from pathlib import Path

from helpers import TinyModels, engine_internals

from spnl_backend import BackendSettings, load_backend
from spnl_backend.engine import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    path = str(TinyModels(Path(tempfile.mkdtemp())).hf("gemma4").path)
    settings = BackendSettings(
        device="cpu", paged_attn=True, paged_cache_type="f16", paged_attn_context_len=args.context
    )
    plan = build._window_plan
    for windowed in (True, False):
        build._window_plan = plan if windowed else (lambda *a, **k: None)
        with load_backend(path, settings=settings) as backend:
            info = backend.cache_info()
            nbytes = engine_internals(backend).runner.cache.cache.nbytes
        print(
            f"windowed pool {'on ' if windowed else 'off'}: {info.capacity_tokens} tokens, "
            f"window_blocks={info.window_blocks}, pool {nbytes / 2**20:.1f} MB"
        )
    build._window_plan = plan


if __name__ == "__main__":
    main()
