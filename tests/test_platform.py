"""Platform decisions on faked machines (the platform table of DESIGN.md), and on this one."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from spnl_backend import BackendSettings, PlatformError
from spnl_backend.settings import PlatformProbe, decide_platform, detect_platform
from spnl_backend.settings.platform import CudaDevice, probe_platform

H100 = CudaDevice(0, "NVIDIA H100", (9, 0), 80 << 30)
A100 = CudaDevice(1, "NVIDIA A100", (8, 0), 40 << 30)
T4 = CudaDevice(0, "Tesla T4", (7, 5), 16 << 30)


def machine(os="linux", cuda=(), mps=False, triton=True, **extra) -> PlatformProbe:
    return PlatformProbe(
        os=os,
        torch_version="2.13.0",
        cuda_devices=tuple(cuda),
        mps_available=mps,
        mps_bf16=mps,
        mps_fp8=False,
        cpu_capability="AVX2",
        triton_version="3.5.0" if triton else None,
        triton_error=None if triton else "not installed",
        **{"c_compiler": "cc", "cpu_int8": True, **extra},
    )


def decide(probe: PlatformProbe, **settings):
    return decide_platform(BackendSettings(**settings), probe)


def test_linux_cuda_defaults_to_paged_triton_and_bf16():
    d = decide(machine(cuda=[H100]))
    assert (d.device, d.device_type, d.device_name) == ("cuda:0", "cuda", "NVIDIA H100")
    assert d.paged_attn
    assert d.paged_attn_supported
    assert d.kernels == "triton"
    assert d.fp8_kv == "native"
    assert d.bf16
    assert d.resolve_dtype(None) == "bfloat16"


def test_cuda_without_triton_uses_torch_kernels_and_says_how_to_fix():
    d = decide(machine(cuda=[H100], triton=False))
    assert d.kernels == "torch"
    assert not d.triton_usable
    assert any("spnl-backend[triton]" in note for note in d.notes)


def test_older_gpu_emulates_fp8_and_lacks_bf16():
    d = decide(machine(cuda=[T4]))
    assert d.fp8_kv == "emulated"
    assert not d.bf16
    assert d.resolve_dtype("bfloat16") == "float16"
    with pytest.raises(PlatformError, match="bfloat16"):
        decide(machine(cuda=[T4]), dtype="bf16")


def test_cuda_index_selects_the_device():
    d = decide(machine(cuda=[H100, A100]), device="cuda:1")
    assert (d.device, d.device_name, d.fp8_kv) == ("cuda:1", "NVIDIA A100", "emulated")


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:2"])
def test_missing_cuda_device_is_a_clear_error(device):
    probe = machine(cuda=[H100, A100]) if device == "cuda:2" else machine()
    with pytest.raises(PlatformError, match="MISTRALRS_DEVICE") as caught:
        decide(probe, device=device)
    assert repr(device) in str(caught.value)


def test_metal_is_off_by_default_but_can_be_asked_for():
    assert decide(machine(os="darwin", mps=True, triton=False)).device == "mps"
    d = decide(machine(os="darwin", mps=True, triton=False))
    assert not d.paged_attn
    assert d.paged_attn_supported
    assert d.kernels == "torch"
    assert decide(machine(os="darwin", mps=True), paged_attn=True).paged_attn


def test_missing_metal_is_a_clear_error():
    with pytest.raises(PlatformError, match="Metal"):
        decide(machine(os="darwin"), device="metal")


def test_metal_without_float8_rejects_fp8_cache():
    with pytest.raises(PlatformError, match="float8"):
        decide(machine(os="darwin", mps=True), paged_attn=True, paged_cache_type="f8e4m3")


def test_cpu_defaults():
    d = decide(machine(triton=False))
    assert (d.device, d.kernels, d.fp8_kv) == ("cpu", "cpu", "emulated")
    assert d.paged_attn
    assert d.paged_attn_supported
    assert d.resolve_dtype("bfloat16") == "float32"


def test_cpu_honours_explicit_dtype_and_device_over_a_gpu():
    d = decide(machine(cuda=[H100]), device="cpu", dtype="bf16")
    assert d.device == "cpu"
    assert d.resolve_dtype("float32") == "bfloat16"


def test_windows_never_pages_and_refuses_an_explicit_request():
    d = decide(machine(os="windows", cuda=[H100]))
    assert not d.paged_attn
    assert not d.paged_attn_supported
    with pytest.raises(PlatformError, match="Windows"):
        decide(machine(os="windows", cuda=[H100]), paged_attn=True)


def test_paged_attn_false_wins_everywhere():
    assert not decide(machine(cuda=[H100]), paged_attn=False).paged_attn


def test_fp8_cache_needs_paged_attention():
    with pytest.raises(PlatformError, match="needs paged attention"):
        decide(machine(), paged_attn=False, paged_cache_type="f8e4m3")
    d = decide(machine(), paged_attn=True, paged_cache_type="f8e4m3")
    assert d.kv_cache_dtype == "float8_e4m3fn"


def test_kv_cache_dtype_auto_is_float16_where_the_native_cpu_kernels_attend():
    assert decide(machine()).kv_cache_dtype == "float16"
    assert decide(machine(), paged_attn=False).kv_cache_dtype == "float16"
    assert decide(machine(), cpu_kernels="torch").kv_cache_dtype == "auto"
    assert decide(machine(c_compiler=None)).kv_cache_dtype == "auto"
    assert decide(machine(cuda=[H100])).kv_cache_dtype == "auto"
    assert decide(machine(), paged_cache_type="f32").kv_cache_dtype == "float32"
    assert decide(machine(), cpu_kernels="torch", paged_cache_type="f16").kv_cache_dtype == (
        "float16"
    )


def test_explicit_float_cache_types_are_refused_with_triton():
    for cache_type in ("f16", "f32"):
        with pytest.raises(PlatformError, match=f"'{cache_type}': the Triton kernels"):
            decide(machine(cuda=[H100]), paged_cache_type=cache_type)
    assert decide(machine(cuda=[H100], triton=False), paged_cache_type="f16").kernels == "torch"


def test_triton_on_cpu_is_usable_only_under_the_interpreter():
    assert not decide(machine()).triton_usable
    assert decide(machine(triton_interpret=True)).triton_usable
    assert decide(machine(triton_interpret=True)).kernels == "cpu"


def test_gpu_keeps_a_half_precision_config_dtype():
    d = decide(machine(cuda=[H100]))
    assert d.resolve_dtype("float16") == "float16"
    assert d.resolve_dtype("float32") == "bfloat16"


def test_this_machine_is_probed_consistently():
    probe = probe_platform()
    assert probe.torch_version == torch.__version__
    assert len(probe.cuda_devices) == (
        torch.cuda.device_count() if torch.cuda.is_available() else 0
    )
    decisions = detect_platform(BackendSettings())
    assert decisions.device_type in ("cpu", "cuda", "mps")


def test_the_probe_imports_triton_only_where_it_could_run():
    """Where there is no CUDA device and no interpreter the installed metadata answers:
    Triton's import costs a quarter of a second and 70 MB of resident library."""
    script = (
        "import sys; from spnl_backend.settings.platform import probe_platform; "
        "p = probe_platform(); print(p.triton_version, p.cuda_devices, 'triton' in sys.modules)"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    version, devices, imported = done.stdout.split()
    installed = importlib.util.find_spec("triton") is not None
    assert (version != "None") == installed
    assert (devices, imported) == ("()", "False")


@pytest.mark.cuda
def test_real_cuda_machine_defaults_to_paged_attention():
    decisions = detect_platform(BackendSettings())
    assert decisions.device_type == "cuda"
    assert decisions.paged_attn


@pytest.mark.metal
def test_real_metal_machine_keeps_paged_attention_off():
    decisions = detect_platform(BackendSettings())
    assert decisions.device_type == "mps"
    assert not decisions.paged_attn


# ---- the CPU's arithmetic: every path the dispatch can pick, chosen by a setting ---------


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        ({"cpu_int8": True, "cpu_bf16_gemm": False}, ("int8", "float32")),
        ({"cpu_int8": True, "cpu_bf16_gemm": True}, ("int8", "bfloat16")),
        ({"cpu_int8": False, "cpu_bf16_gemm": True}, ("float32", "float32")),
    ],
    ids=["avx2", "avx512-bf16", "no-avx2"],
)
def test_auto_picks_the_cpu_arithmetic_from_the_machine(probe, expected):
    d = decide(machine(**probe), batch_invariant=False)
    assert (d.kernels, d.cpu_matmul, d.cpu_gemm) == ("cpu", *expected)


@pytest.mark.parametrize("int8", [True, False])
def test_batch_invariance_is_the_default_and_takes_no_gemm(int8):
    d = decide(machine(cpu_int8=int8, cpu_bf16_gemm=True))
    assert d.batch_invariant
    assert (d.cpu_matmul, d.cpu_gemm) == ("int8" if int8 else "float32", None)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"cpu_matmul": "float32"}, ("cpu", "float32", "float32")),
        ({"cpu_gemm": "float32"}, ("cpu", "int8", "float32")),
        ({"cpu_matmul": "float32", "cpu_gemm": "bfloat16"}, ("cpu", "float32", "bfloat16")),
        ({"cpu_kernels": "torch"}, ("torch", None, None)),
        ({"cpu_kernels": "native"}, ("cpu", "int8", "bfloat16")),
    ],
)
def test_each_cpu_path_can_be_forced(settings, expected):
    d = decide(machine(cpu_bf16_gemm=True), batch_invariant=False, **settings)
    assert (d.kernels, d.cpu_matmul, d.cpu_gemm) == expected


def test_without_a_compiler_the_torch_kernels_run_with_a_note():
    d = decide(machine(c_compiler=None))
    assert (d.kernels, d.cpu_matmul, d.c_compiler) == ("torch", None, None)
    assert any("no C compiler" in note for note in d.notes)
    with pytest.raises(PlatformError, match="MISTRALRS_CPU_KERNELS=native, but no C compiler"):
        decide(machine(c_compiler=None), cpu_kernels="native")


def test_int8_products_need_avx2():
    with pytest.raises(PlatformError, match="MISTRALRS_CPU_MATMUL=int8 needs an x86 CPU"):
        decide(machine(cpu_int8=False), cpu_matmul="int8")


def test_native_checks_apply_only_where_the_native_kernels_run():
    assert decide(machine(), native_checks=True).native_checks
    assert not decide(machine(), native_checks=True, cpu_kernels="torch").native_checks


@pytest.mark.parametrize(
    ("probe", "settings", "variables"),
    [
        (
            {},
            {"paged_attn": False, "paged_attn_block_size": 16, "paged_attn_memory_mb": 64},
            ["MISTRALRS_PAGED_ATTN_BLOCK_SIZE", "MISTRALRS_PAGED_ATTN_MEMORY_MB"],
        ),
        ({}, {"prefix_cache_n": 4}, ["MISTRALRS_PREFIX_CACHE_N"]),
        ({}, {"prefix_cache_n": 1}, []),
        ({}, {"paged_attn": False, "prefix_cache_n": 4}, []),
        ({}, {"speculative_gamma": 4}, []),  # auto without a draft runs ngram, which it bounds
        (
            {},
            {"speculative_gamma": 4, "speculative_method": "none"},
            ["MISTRALRS_SPECULATIVE_GAMMA"],
        ),
        ({}, {"speculative_gamma": 4, "speculative_draft_isq": "Q8_0"}, []),
        (
            {"cuda": [H100]},
            {"cpu_matmul": "float32", "native_checks": True},
            ["MISTRALRS_CPU_MATMUL", "MISTRALRS_NATIVE_CHECKS"],
        ),
        ({}, {"cpu_kernels": "torch", "cpu_gemm": "float32"}, ["MISTRALRS_CPU_GEMM"]),
        ({}, {"cpu_gemm": "bfloat16"}, ["MISTRALRS_CPU_GEMM"]),
        ({}, {"cpu_gemm": "bfloat16", "batch_invariant": False}, []),
        ({}, {"cpu_matmul": "float32", "paged_attn_context_len": 1024}, []),
        (
            {},
            {"paged_attn": False, "pic_reuse": "relaxed", "pic_positions": "local"},
            ["MISTRALRS_PIC_REUSE", "MISTRALRS_PIC_POSITIONS"],
        ),
        ({}, {"pic_reuse": "relaxed", "prefix_cache_n": 0}, ["MISTRALRS_PIC_REUSE"]),
        ({}, {"pic_reuse": "relaxed", "pic_positions": "local"}, []),
        (
            {},
            {"kv_cache_compression": "int8", "span_query_reuse": "exact", "span_template": "spnl"},
            ["MISTRALRS_SPAN_QUERY_REUSE", "MISTRALRS_SPAN_TEMPLATE"],
        ),
    ],
)
def test_settings_without_effect_are_named(probe, settings, variables, monkeypatch):
    from spnl_backend.settings.effects import ineffective_settings

    monkeypatch.delenv("MISTRALRS_NATIVE_CHECKS")  # the suite's own, a setting like any other
    full = BackendSettings(**settings)
    found = ineffective_settings(full, decide_platform(full, machine(**probe)))
    assert [variable for variable, _ in found] == variables
    assert all(reason for _, reason in found)


def test_settings_without_effect_are_logged(monkeypatch, caplog):
    monkeypatch.setenv("MISTRALRS_PAGED_ATTN", "false")
    monkeypatch.setenv("MISTRALRS_PAGED_ATTN_CONTEXT_LEN", "2048")
    monkeypatch.setenv("MISTRALRS_DEVICE", "cpu")
    with caplog.at_level("WARNING", logger="spnl_backend"):
        detect_platform(BackendSettings())
    assert "settings.no_effect" in caplog.text
    assert "MISTRALRS_PAGED_ATTN_CONTEXT_LEN" in caplog.text
