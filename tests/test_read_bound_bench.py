"""bench/read_bound.py: the read bound measured by bench/read_bound.c, compiled here, on as
many threads as asked; a torch sum where no C compiler is found; a failed compile said."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import read_bound
import vector_rates

from spnl_backend.settings.platform import find_c_compiler

SMALL = 1 / 64  # GiB asked: the buffer is then 4x the L3, or 16 MiB where none is known


@pytest.fixture(scope="module")
def library():
    if find_c_compiler() is None:
        pytest.skip("no C compiler")
    return read_bound.build_reader()


def no_compiler(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """$CC names a missing binary and PATH holds no compiler."""
    monkeypatch.setenv("CC", str(folder / "missing-cc"))
    monkeypatch.setenv("PATH", str(folder))


def test_with_a_compiler_the_bound_is_read_bound_c(library):
    found = read_bound.read_bandwidth(1, gib=SMALL, repeats=2)
    assert found["method"] == read_bound.NATIVE
    assert 0.1 < found["gb_s"] < 10_000


def test_without_a_compiler_the_bound_is_a_torch_sum(monkeypatch, tmp_path, capsys):
    no_compiler(monkeypatch, tmp_path)
    assert read_bound.build_reader() is None
    found = read_bound.read_bandwidth(2, gib=SMALL, repeats=2)
    assert found["method"] == read_bound.TORCH_SUM
    assert 0.1 < found["gb_s"] < 10_000
    assert "no C compiler found" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("build", "source"),
    [(read_bound.build_reader, "read_bound"), (vector_rates.build, "vector_rates")],
)
def test_a_failed_compile_says_why(monkeypatch, tmp_path, build, source):
    """Every bench's C file goes through harness.compile_shared: the file and the
    compiler's own message in the error."""
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\necho 'cc: fatal error: no space' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    with pytest.raises(RuntimeError, match=rf"could not compile .*{source}\.c: cc: fatal error"):
        build()


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_the_read_runs_on_as_many_threads_as_asked(library):
    data = torch.ones(2**24, dtype=torch.uint8)
    read = read_bound.reader(library, [(data.data_ptr(), data.numel())], 3, read_bound.WHOLE)
    stop = threading.Event()

    def keep_reading() -> None:
        while not stop.is_set():
            read()

    before = task_count()
    worker = threading.Thread(target=keep_reading)
    worker.start()
    seen, deadline = before, time.monotonic() + 5
    while seen < before + 3 and time.monotonic() < deadline:  # the worker and 2 more
        seen = max(seen, task_count())
    stop.set()
    worker.join()
    assert seen == before + 3


def test_zero_threads_is_refused(library):
    data = torch.ones(256, dtype=torch.uint8)
    read = read_bound.reader(library, [(data.data_ptr(), 256)], 0, read_bound.WHOLE)
    with pytest.raises(OSError, match="could not start 0 threads"):
        read()
    with pytest.raises(ValueError, match="at least 1"):
        read_bound.read_bandwidth(0)


def test_the_l3_counts_each_shared_instance_once(tmp_path):
    def cache(cpu: int, index: int, level: int, size: str, shared: str) -> None:
        folder = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
        folder.mkdir(parents=True)
        for name, value in (("level", level), ("size", size), ("shared_cpu_list", shared)):
            (folder / name).write_text(f"{value}\n")

    for cpu in range(4):  # two L3s of 32 MiB, each shared by two CPUs; a private L2 each
        cache(cpu, 2, 2, "1024K", str(cpu))
        cache(cpu, 3, 3, "32768K", "0-1" if cpu < 2 else "2-3")
    assert read_bound.l3_bytes(tmp_path) == 64 * 2**20
    assert read_bound.l3_bytes(tmp_path / "absent") == 0
