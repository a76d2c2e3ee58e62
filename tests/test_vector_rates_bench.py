"""bench/vector_rates.py: the per-instruction probes compiled for this CPU (its AVX-512 and
VNNI probes exactly where the CPU has them), each a cycle count; no compiler said (a failed
compile: tests/test_read_bound_bench.py, for every bench's C file)."""

import math
import platform
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import vector_rates

from spnl_backend.settings.platform import cpuinfo_lines, cpuinfo_value, find_c_compiler


def cpu_flags() -> set[str]:
    line = (cpuinfo_lines("flags") or {}).get("flags", "")
    return set(cpuinfo_value(line).split())


@pytest.fixture(scope="module")
def library():
    if find_c_compiler() is None:
        pytest.skip("no C compiler")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the probes are x86-64 instructions")
    return vector_rates.build()


def test_every_probe_gives_a_cycle_count(library):
    hz, rows = vector_rates.rates(library, trips=20_000, repeats=1)
    assert hz > 0
    assert rows, "no probes"
    for name, cycles in rows:
        assert math.isfinite(cycles), name
        assert cycles > 0, name


def test_the_probes_are_the_ones_this_cpu_runs(library):
    names = [name for name, _ in vector_rates.rates(library, trips=10, repeats=1)[1]]
    flags = cpu_flags()
    assert any(n.startswith("zmm") for n in names) == ("avx512bw" in flags)
    assert any("vpdpbusd" in n for n in names) == ("avx512_vnni" in flags)
    assert any(n.startswith("ymm vp") for n in names) == ("avx2" in flags)


def test_without_a_compiler_it_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "missing-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match="no C compiler found"):
        vector_rates.build()
