"""A stand-in for llama.cpp's llama-bench, for the benches' tests: a script that records
its arguments and answers with JSON rows shaped as the real one's."""

import sys
from pathlib import Path

SCRIPT = """\
import json, sys
a = sys.argv[1:]
with open({calls!r}, "a") as calls:
    calls.write(json.dumps(a) + "\\n")
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
depths = [int(d) for d in a[a.index("-d") + 1].split(",")] if "-d" in a else [0]
build = {{"build_commit": "abc", "build_number": 7, "cpu_info": "X", "type_k": "f16",
         "flash_attn": -1, "n_ubatch": 512, "stddev_ts": 0.5}}
rows = []
for d in depths:
    if p:
        rows.append(build | {{"n_prompt": p, "n_gen": 0, "n_depth": d, "avg_ts": {prefill}}})
    if n:
        ts = {decode} / (1 + d // 1024)
        rows.append(build | {{"n_prompt": 0, "n_gen": n, "n_depth": d, "avg_ts": ts}})
print(json.dumps(rows))
"""


def fake_llama_bench(folder: Path, prefill_ts: float = 1000.0, decode_ts: float = 1000.0) -> Path:
    """A llama-bench in ``folder`` that appends each call's arguments (a JSON list) to
    ``folder / "calls"`` and prints, as the real one, a row per test and depth (``-d D,...``;
    0 without): a pp row for ``-p P`` (P > 0) at ``prefill_ts`` tok/s, a tg row for
    ``-n N`` (N > 0) at ``decode_ts`` / (1 + D // 1024) tok/s."""
    script = folder / "llama-bench"
    body = SCRIPT.format(calls=str(folder / "calls"), prefill=prefill_ts, decode=decode_ts)
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(0o755)
    return script
