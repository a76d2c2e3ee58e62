"""Every row of the MISTRALRS_* table, valid and invalid, from the environment and from code."""

import logging
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from spnl_backend import BackendSettings, SettingsError, load_settings
from spnl_backend.settings import IsqType, env_name
from spnl_backend.settings.values import BLOCK_SIZES

VALID = [
    ("PAGED_ATTN", "auto", "auto"),
    ("PAGED_ATTN", "AUTO", "auto"),
    *[("PAGED_ATTN", text, True) for text in ("true", "True", "1", "on", "ON", "yes", "Yes")],
    *[("PAGED_ATTN", text, False) for text in ("false", "FALSE", "0", "off", "Off", "no", "NO")],
    *[("PAGED_ATTN_BLOCK_SIZE", str(size), size) for size in BLOCK_SIZES],
    ("PAGED_ATTN_BLOCK_SIZE", " 64 ", 64),
    ("PREFIX_CACHE_N", "0", 0),
    ("PREFIX_CACHE_N", "16", 16),
    ("PREFIX_CACHE_N", "500", 500),
    ("PREFIX_CACHE_N", "false", 0),
    ("PREFIX_CACHE_N", "False", 0),
    ("ISQ", "none", None),
    ("ISQ", "None", None),
    ("ISQ", "false", None),
    *[("ISQ", t.value, t) for t in IsqType],
    *[("ISQ", t.value.lower(), t) for t in IsqType],
    ("ISQ", "Q4_K", IsqType.Q4K),
    ("ISQ", "q4k", IsqType.Q4K),
    ("ISQ", "Q4_K_M", IsqType.Q4K),
    ("ISQ", "Q4_K_S", IsqType.Q4K),
    ("ISQ", "q5_k_m", IsqType.Q5K),
    ("ISQ", "Q3_K_L", IsqType.Q3K),
    ("ISQ", "Q6_K", IsqType.Q6K),
    ("ISQ", "Q8", IsqType.Q8_0),
    ("ISQ", "2", IsqType.Q2K),
    ("ISQ", "3", IsqType.Q3K),
    ("ISQ", "4", IsqType.Q4K),
    ("ISQ", "5", IsqType.Q5K),
    ("ISQ", "6", IsqType.Q6K),
    ("ISQ", "8", IsqType.Q8_0),
    ("PAGED_ATTN_MEMORY_MB", "4096", 4096),
    ("PAGED_ATTN_MEMORY_FRACTION", "0.9", 0.9),
    ("PAGED_ATTN_MEMORY_FRACTION", "1", 1.0),
    ("PAGED_ATTN_CONTEXT_LEN", "1024", 1024),
    ("PAGED_CACHE_TYPE", "auto", "auto"),
    ("PAGED_CACHE_TYPE", "f8e4m3", "f8e4m3"),
    ("PAGED_CACHE_TYPE", "F8E4M3", "f8e4m3"),
    ("PAGED_CACHE_TYPE", "f16", "f16"),
    ("PAGED_CACHE_TYPE", "F32", "f32"),
    ("SPECULATIVE_DRAFT_MODEL", "google/gemma-3-270m", "google/gemma-3-270m"),
    ("SPECULATIVE_DRAFT_MODEL", "/models/draft.gguf", "/models/draft.gguf"),
    ("SPECULATIVE_GAMMA", "1", 1),
    ("SPECULATIVE_GAMMA", "16", 16),
    ("SPECULATIVE_DRAFT_ISQ", "Q8_0", IsqType.Q8_0),
    ("SPECULATIVE_DRAFT_ISQ", "4", IsqType.Q4K),
    ("SPECULATIVE_DRAFT_ISQ", "none", None),
    ("SPECULATIVE_METHOD", "ngram", "ngram"),
    ("SPECULATIVE_METHOD", "NONE", "none"),
    ("SPECULATIVE_METHOD", "auto", "auto"),
    ("SPECULATIVE_NGRAM_MIN", "1", 1),
    ("SPECULATIVE_NGRAM_MAX", "8", 8),
    ("SPECULATIVE_METHOD", "Suffix", "suffix"),
    ("SPECULATIVE_SUFFIX_TOKENS", "4096", 4096),
    ("KV_CACHE_COMPRESSION", "none", "none"),
    ("KV_CACHE_COMPRESSION", "NONE", "none"),
    ("CPU_KERNELS", "auto", "auto"),
    ("CPU_KERNELS", "Native", "native"),
    ("CPU_KERNELS", "torch", "torch"),
    ("CPU_MATMUL", "int8", "int8"),
    ("CPU_MATMUL", "FLOAT32", "float32"),
    ("CPU_GEMM", "bfloat16", "bfloat16"),
    ("CPU_GEMM", "float32", "float32"),
    ("BATCH_INVARIANT", "false", False),
    ("BATCH_INVARIANT", "1", True),
    ("PIC_REUSE", "exact", "exact"),
    ("PIC_REUSE", "Relaxed", "relaxed"),
    ("PIC_REUSE", "TOKENS", "tokens"),
    ("SPAN_QUERY_REUSE", "exact", "exact"),
    ("SPAN_QUERY_REUSE", "tokens", "tokens"),
    ("SPAN_TEMPLATE", "spnl", "spnl"),
    ("SPAN_TEMPLATE", " Model ", "model"),
    ("NUM_THREADS", "auto", "auto"),
    ("NUM_THREADS", " 4 ", 4),
    ("PIC_POSITIONS", "after_prefix", "after_prefix"),
    ("PIC_POSITIONS", "LOCAL", "local"),
    ("PIC_RECOMPUTE", "0", 0.0),
    ("PIC_RECOMPUTE", "0.15", 0.15),
    ("PIC_RECOMPUTE", " 1 ", 1.0),
    ("PIC_RECOMPUTE_SELECT", "Deviation", "deviation"),
    ("PIC_RECOMPUTE_SELECT", "first", "first"),
    ("NATIVE_CHECKS", "1", True),
    ("NATIVE_CHECKS", "off", False),
    ("TOKEN_HEALING", "true", True),
    ("TOKEN_HEALING", "No", False),
    ("NO_NCCL", "1", True),
    ("MN_GLOBAL_WORLD_SIZE", "8", 8),
    ("MN_LOCAL_WORLD_SIZE", " 2 ", 2),
    ("MN_HEAD_NUM_WORKERS", "0", 0),
    ("MN_HEAD_PORT", "29500", 29500),
    ("MN_WORKER_SERVER_ADDR", "10.0.0.1:29500", "10.0.0.1:29500"),
    ("MN_WORKER_SERVER_ADDR", "[::1]:29500", "[::1]:29500"),
    ("MN_WORKER_SERVER_ADDR", "head.local:1", "head.local:1"),
    ("MN_WORKER_ID", "3", 3),
    ("COLLECTIVE_TIMEOUT_S", "2.5", 2.5),
    ("DEVICE_LAYERS", "0:16;1:16", ((0, 16), (1, 16))),
    ("DEVICE_LAYERS", " 1:2; 0:30; ", ((1, 2), (0, 30))),
    ("MODEL", "org/Some-Model-GGUF", "org/Some-Model-GGUF"),
    ("MODEL_IMPL", "auto", "auto"),
    ("MODEL_IMPL", "Transformers", "transformers"),
    ("MODEL_IMPL", "native", "native"),
    ("DEVICE", "auto", "auto"),
    ("DEVICE", "cpu", "cpu"),
    ("DEVICE", "CPU", "cpu"),
    ("DEVICE", "cuda", "cuda"),
    ("DEVICE", "cuda:1", "cuda:1"),
    ("DEVICE", "mps", "mps"),
    ("DEVICE", "metal", "mps"),
    ("DTYPE", "auto", "auto"),
    ("DTYPE", "float32", "float32"),
    ("DTYPE", "f32", "float32"),
    ("DTYPE", "fp16", "float16"),
    ("DTYPE", "half", "float16"),
    ("DTYPE", "bf16", "bfloat16"),
    ("DTYPE", "BFloat16", "bfloat16"),
    ("VERBOSE", "1", True),
    ("VERBOSE", "yes", True),
    ("VERBOSE", "off", False),
    ("KV_TIER_DIR", "/var/tmp/spnl-kv-tier", "/var/tmp/spnl-kv-tier"),
    ("KV_TIER_DIR", "~/kv-tier", os.path.expanduser("~/kv-tier")),
    ("KV_TIER_MB", "512", 512),
    ("CHAT_TEMPLATE", "{{ messages }}\n", "{{ messages }}\n"),
    ("REASONING_FORMAT", "think", "think"),
    ("REASONING_FORMAT", "DeepSeek", "think"),
    ("REASONING_FORMAT", "gpt-oss", "harmony"),
    ("LORA_ADAPTERS", " sql = /a/b , chat=~/c ", "sql=/a/b,chat=~/c"),
    ("LORA_ADAPTERS", "org/name:v2=x", "org/name:v2=x"),
    ("LORA_MAX_LOADED", "4", 4),
    ("LORA_MAX_LOADED", "0", 0),
    ("DEFAULT_CHAT_TEMPLATE_KWARGS", '{"enable_thinking": false}', '{"enable_thinking": false}'),
]

INVALID = [
    ("PAGED_ATTN", "enabled"),
    ("PAGED_ATTN", "2"),
    *[("PAGED_ATTN_BLOCK_SIZE", text) for text in ("33", "0", "4", "512", "-32", "32.5", "big")],
    *[("PREFIX_CACHE_N", text) for text in ("-1", "true", "1.5", "many")],
    *[
        ("ISQ", text)
        for text in ("Q7K", "Q8K", "Q4", "Q4_2", "Q9_0", "Q4_K_X", "gptq", "1", "7", "9", "0")
    ],
    # other scripts' digits, which int() and float() read, are not numbers here
    *[("PAGED_ATTN_MEMORY_MB", text) for text in ("0", "-5", "4GB", "1.5", "\uff11", "\u0663")],
    *[("PAGED_ATTN_MEMORY_FRACTION", text) for text in ("0", "1.5", "-0.1", "most", "\uff10.5")],
    *[("PAGED_ATTN_CONTEXT_LEN", text) for text in ("0", "4k")],
    *[("PAGED_CACHE_TYPE", text) for text in ("fp8", "bf16", "e5m2", "float16", "f64")],
    *[("PIC_REUSE", text) for text in ("approx", "1", "true")],
    *[("SPAN_QUERY_REUSE", text) for text in ("spnl", "yes")],
    *[("SPAN_TEMPLATE", text) for text in ("jinja", "llama3")],
    *[("NUM_THREADS", text) for text in ("0", "257", "many", "2.5")],
    *[("PIC_POSITIONS", text) for text in ("spnl", "block_local", "0")],
    *[("PIC_RECOMPUTE", text) for text in ("-0.1", "1.5", "15%", "nan", "true")],
    *[("PIC_RECOMPUTE_SELECT", text) for text in ("cacheblend", "1", "last")],
    ("SPECULATIVE_DRAFT_MODEL", "   "),
    *[("SPECULATIVE_GAMMA", text) for text in ("0", "-1", "four")],
    ("SPECULATIVE_DRAFT_ISQ", "Q9"),
    *[("SPECULATIVE_METHOD", text) for text in ("medusa", "n-gram", "1")],
    *[("SPECULATIVE_NGRAM_MIN", text) for text in ("0", "two")],
    ("SPECULATIVE_NGRAM_MAX", "-3"),
    *[("SPECULATIVE_SUFFIX_TOKENS", text) for text in ("0", "lots")],
    ("KV_CACHE_COMPRESSION", "turbo"),
    *[("CPU_KERNELS", text) for text in ("c", "triton", "1")],
    *[("CPU_MATMUL", text) for text in ("int4", "fp32", "bf16")],
    *[("CPU_GEMM", text) for text in ("f32", "int8")],
    ("NATIVE_CHECKS", "debug"),
    ("TOKEN_HEALING", "sometimes"),
    ("NO_NCCL", "2"),
    ("MN_GLOBAL_WORLD_SIZE", "0"),
    ("MN_LOCAL_WORLD_SIZE", "two"),
    ("MN_HEAD_NUM_WORKERS", "-1"),
    *[("MN_HEAD_PORT", text) for text in ("0", "65536", "http")],
    *[("MN_WORKER_SERVER_ADDR", text) for text in ("10.0.0.1", "host:0", ":29500", "a b:1")],
    ("MN_WORKER_ID", "-2"),
    *[("COLLECTIVE_TIMEOUT_S", text) for text in ("0", "-1", "nan", "forever", "1e9")],
    *[("DEVICE_LAYERS", text) for text in ("0:0", "0:2;0:3", "cuda:0:2", "0", "0:2,1:2")],
    ("MODEL", "  "),
    *[("MODEL_IMPL", text) for text in ("hf", "vllm", "1")],
    *[("DEVICE", text) for text in ("gpu", "cuda:x", "cpu:1", "tpu")],
    *[("DTYPE", text) for text in ("float64", "int8")],
    ("VERBOSE", "maybe"),
    ("KV_TIER_DIR", __file__),  # a file, not a directory
    *[("KV_TIER_MB", text) for text in ("0", "-1", "lots")],
    ("CHAT_TEMPLATE", "   "),
    *[("REASONING_FORMAT", text) for text in ("r1", "on", "true")],
    *[("LORA_ADAPTERS", text) for text in ("sql", "=/a", "a=", "a=x,a=y", "bad name=x")],
    *[("LORA_MAX_LOADED", text) for text in ("-1", "two", "1.5")],
    *[("DEFAULT_CHAT_TEMPLATE_KWARGS", text) for text in ("[1]", "{", '{"tools": []}')],
]


def _field(suffix: str) -> str:
    return suffix.lower()


@pytest.mark.parametrize(("suffix", "text", "expected"), VALID)
def test_valid_env_value(monkeypatch, suffix, text, expected):
    monkeypatch.setenv("MISTRALRS_" + suffix, text)
    assert getattr(BackendSettings(), _field(suffix)) == expected


@pytest.mark.parametrize(("suffix", "text"), INVALID)
def test_invalid_env_value_names_variable_value_and_accepted(monkeypatch, suffix, text):
    monkeypatch.setenv("MISTRALRS_" + suffix, text)
    with pytest.raises(SettingsError) as caught:
        BackendSettings()
    message = str(caught.value)
    assert f"MISTRALRS_{suffix}={text!r}" in message
    assert "expected" in message
    assert "\n" not in message


@pytest.mark.parametrize(("suffix", "text", "expected"), VALID)
def test_valid_value_in_code(suffix, text, expected):
    assert getattr(BackendSettings(**{_field(suffix): text}), _field(suffix)) == expected


@pytest.mark.parametrize(("suffix", "text"), INVALID)
def test_invalid_value_in_code_is_rejected_the_same_way(suffix, text):
    with pytest.raises(SettingsError) as caught:
        BackendSettings(**{_field(suffix): text})
    assert f"{_field(suffix)}={text!r}" in str(caught.value)
    assert f"MISTRALRS_{suffix}" in str(caught.value)


def test_defaults():
    settings = BackendSettings()
    assert settings.paged_attn == "auto"
    assert settings.paged_attn_block_size == 32
    assert settings.prefix_cache_n == 16
    assert settings.prefix_cache_enabled
    assert settings.isq is None
    assert settings.paged_cache_type == "auto"
    assert settings.kv_cache_compression == "none"
    assert settings.device == "auto"
    assert settings.dtype == "auto"
    assert settings.verbose is False
    budget = settings.kv_budget
    assert (budget.kind, budget.value, budget.explicit) == ("context_len", 4096, False)


def test_native_values_in_code():
    settings = BackendSettings(
        paged_attn=True,
        prefix_cache_n=0,
        isq=4,
        speculative_draft_model="draft",
        speculative_gamma=8,
        paged_attn_memory_fraction=0.5,
    )
    assert settings.paged_attn is True
    assert not settings.prefix_cache_enabled
    assert settings.isq is IsqType.Q4K
    assert settings.speculative_gamma == 8
    assert settings.kv_budget.kind == "memory_fraction"
    assert settings.kv_budget.value == 0.5


@pytest.mark.parametrize("value", [True, 1.5, -3])
def test_prefix_cache_rejects_true_and_non_integers_in_code(value):
    with pytest.raises(SettingsError, match="prefix_cache_n"):
        BackendSettings(prefix_cache_n=value)


def test_prefix_cache_false_in_code_disables():
    assert BackendSettings(prefix_cache_n=False).prefix_cache_n == 0


def test_settings_are_frozen():
    settings = BackendSettings()
    with pytest.raises(ValidationError):
        settings.paged_attn_block_size = 64


@pytest.mark.parametrize(
    "budget",
    [
        {"PAGED_ATTN_MEMORY_MB": "1024", "PAGED_ATTN_MEMORY_FRACTION": "0.5"},
        {"PAGED_ATTN_MEMORY_MB": "1024", "PAGED_ATTN_CONTEXT_LEN": "2048"},
        {"PAGED_ATTN_MEMORY_FRACTION": "0.5", "PAGED_ATTN_CONTEXT_LEN": "2048"},
        {
            "PAGED_ATTN_MEMORY_MB": "1",
            "PAGED_ATTN_MEMORY_FRACTION": "0.5",
            "PAGED_ATTN_CONTEXT_LEN": "2",
        },
    ],
)
def test_two_kv_budgets_are_an_error_naming_both(monkeypatch, budget):
    for suffix, text in budget.items():
        monkeypatch.setenv("MISTRALRS_" + suffix, text)
    with pytest.raises(SettingsError, match="at most one KV-cache budget") as caught:
        BackendSettings()
    for suffix in budget:
        assert f"MISTRALRS_{suffix}=" in str(caught.value)


@pytest.mark.parametrize(
    ("suffix", "kind", "value"),
    [
        ("PAGED_ATTN_MEMORY_MB", "memory_mb", 2048),
        ("PAGED_ATTN_MEMORY_FRACTION", "memory_fraction", 0.25),
        ("PAGED_ATTN_CONTEXT_LEN", "context_len", 8192),
    ],
)
def test_one_kv_budget_is_used(monkeypatch, suffix, kind, value):
    monkeypatch.setenv("MISTRALRS_" + suffix, str(value))
    budget = BackendSettings().kv_budget
    assert (budget.kind, budget.value, budget.explicit) == (kind, value, True)


def test_empty_variable_counts_as_unset(monkeypatch):
    monkeypatch.setenv("MISTRALRS_PAGED_ATTN_BLOCK_SIZE", "")
    monkeypatch.setenv("MISTRALRS_ISQ", "")
    settings = BackendSettings()
    assert settings.paged_attn_block_size == 32
    assert settings.isq is None


def test_every_bad_variable_is_reported_in_one_error(monkeypatch):
    monkeypatch.setenv("MISTRALRS_PAGED_ATTN_BLOCK_SIZE", "33")
    monkeypatch.setenv("MISTRALRS_ISQ", "Q9")
    with pytest.raises(SettingsError) as caught:
        BackendSettings()
    assert "MISTRALRS_PAGED_ATTN_BLOCK_SIZE='33'" in str(caught.value)
    assert "MISTRALRS_ISQ='Q9'" in str(caught.value)


def test_unknown_setting_in_code_is_an_error():
    with pytest.raises(SettingsError, match="unknown setting 'paged_atn'"):
        BackendSettings(paged_atn=True)


def test_every_field_has_its_variable():
    names = {env_name(field) for field in BackendSettings.model_fields}
    for suffix, *_ in VALID + INVALID:
        assert "MISTRALRS_" + suffix in names
    assert {s for s, *_ in VALID} == {n.removeprefix("MISTRALRS_") for n in names}


def test_sources_say_env_or_default(monkeypatch):
    monkeypatch.setenv("MISTRALRS_ISQ", "Q4K")
    sources = BackendSettings.sources()
    assert sources["isq"] == "env"
    assert sources["paged_attn"] == "default"


def test_load_settings_warns_about_unknown_variables(monkeypatch, caplog):
    monkeypatch.setenv("MISTRALRS_PAGED_ATN", "1")
    with caplog.at_level(logging.WARNING, logger="spnl_backend"):
        load_settings()
    assert "settings.unknown_variable" in caplog.text
    assert "MISTRALRS_PAGED_ATN" in caplog.text


@given(st.integers(min_value=-1000, max_value=1000))
def test_block_size_accepts_exactly_the_powers_of_two(size):
    if size in (8, 16, 32, 64, 128, 256):
        assert BackendSettings(paged_attn_block_size=size).paged_attn_block_size == size
    else:
        with pytest.raises(SettingsError, match="power of two"):
            BackendSettings(paged_attn_block_size=size)


@given(st.sampled_from(["true", "false", "on", "off", "yes", "no"]), st.data())
def test_booleans_are_case_insensitive(word, data):
    flips = data.draw(st.lists(st.booleans(), min_size=len(word), max_size=len(word)))
    spelled = "".join(c.upper() if flip else c for c, flip in zip(word, flips, strict=True))
    assert BackendSettings(verbose=spelled).verbose is (word in ("true", "on", "yes"))


@pytest.mark.parametrize(
    ("context", "block", "suggestion"), [(1, 32, "use 32$"), (5000, 32, "use 4992 or 5024")]
)
def test_a_context_of_part_blocks_is_refused_not_rounded(monkeypatch, context, block, suggestion):
    monkeypatch.setenv("MISTRALRS_PAGED_ATTN_CONTEXT_LEN", str(context))
    monkeypatch.setenv("MISTRALRS_PAGED_ATTN_BLOCK_SIZE", str(block))
    with pytest.raises(SettingsError, match=f"CONTEXT_LEN={context} is not a whole number.*"):
        BackendSettings()
    with pytest.raises(SettingsError, match=suggestion):
        BackendSettings()
