"""How much memory the process may take: the least of the machine's, its cgroup's and its
rlimits' headroom, so a memory-fraction budget is sized from what a container allows."""

import subprocess
import sys
import textwrap

import pytest

from spnl_backend.memory import cgroup_headroom, host_available_memory

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="cgroups and /proc: Linux")
GIB = 1 << 30


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_less_usage_of_the_tightest_ancestor(tmp_path):
    _write(tmp_path / "proc", "0::/box/job\n")
    _write(tmp_path / "cg/box/job/memory.max", "max\n")
    _write(tmp_path / "cg/box/job/memory.current", str(1 * GIB))
    _write(tmp_path / "cg/box/memory.max", str(3 * GIB))
    _write(tmp_path / "cg/box/memory.current", str(2 * GIB))
    assert cgroup_headroom(tmp_path / "cg", tmp_path / "proc") == 1 * GIB


def test_cgroup_v1_memory_controller(tmp_path):
    _write(tmp_path / "proc", "5:cpu,cpuacct:/a\n4:memory:/docker/abc\n")
    _write(tmp_path / "cg/memory/docker/abc/memory.limit_in_bytes", str(4 * GIB))
    _write(tmp_path / "cg/memory/docker/abc/memory.usage_in_bytes", str(GIB))
    _write(tmp_path / "cg/memory/memory.limit_in_bytes", "9223372036854771712")
    _write(tmp_path / "cg/memory/memory.usage_in_bytes", str(5 * GIB))
    assert cgroup_headroom(tmp_path / "cg", tmp_path / "proc") == 3 * GIB


def test_no_cgroup_limit_is_none(tmp_path):
    _write(tmp_path / "proc", "0::/\n")
    _write(tmp_path / "cg/memory.max", "max\n")
    _write(tmp_path / "cg/memory.current", "123\n")
    assert cgroup_headroom(tmp_path / "cg", tmp_path / "proc") is None
    assert cgroup_headroom(tmp_path / "cg", tmp_path / "missing") is None


def test_this_process_has_some_memory():
    assert host_available_memory() > 0


def test_an_address_space_limit_sizes_a_memory_fraction_budget(tiny):
    """``ulimit -v``: the KV cache takes a fraction of what the limit leaves and the model
    generates, where sizing from the machine's memory would fail to allocate."""
    script = textwrap.dedent(
        f"""
        import resource
        from spnl_backend import BackendSettings, load_backend
        from spnl_backend.memory import host_available_memory, _status_bytes
        resource.setrlimit(resource.RLIMIT_AS, (_status_bytes("VmSize") + (1 << 30),) * 2)
        settings = BackendSettings(device="cpu", paged_attn=True, paged_attn_memory_fraction=1.0)
        backend = load_backend({str(tiny.hf("llama").path)!r}, settings=settings)
        pool = backend.stats().pool.blocks * backend.settings.paged_attn_block_size
        done = backend.generate("hi", max_tokens=3, ignore_eos=True)  # 3, whatever it samples
        print("tokens", pool, "ok", done.usage.completion_tokens)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ok 3" in done.stdout
