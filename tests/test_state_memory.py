"""The memory of hybrid models' state layers (Qwen3.5's Gated DeltaNet, Granite 4.0-H's
Mamba-2, Falcon-H1's Mamba-2 beside attention in every layer, Jamba's Mamba-1): each
sequence's states counted from the model's config, the byte budget shared between KV
blocks and state slots and snapshots, admission that waits for a free slot, snapshots
within their bound, what cannot fit refused with its figures, and the settings a model
with state layers refuses at load."""

import os

import pytest
from helpers import SHARED_PREFIX_PROMPTS, engine_internals
from prometheus_client import generate_latest
from tiny_models import HYBRID_ARCHITECTURES

from spnl_backend import BackendSettings, PlatformError, SettingsError, load_backend
from spnl_backend.engine import build
from spnl_backend.engine.budget import STEP_RESERVE_BYTES, StatePlan, fit_states
from spnl_backend.server.metrics import ServerMetrics
from spnl_backend.settings.backend_settings import KvBudget

TOKENS = 16
MIB = 1 << 20
FLOAT32 = 4  # the tiny models' dtype, and the pool's with paged_cache_type="f32"


def _load(tiny, arch, **settings):
    settings = {"device": "cpu", "paged_cache_type": "f32"} | settings
    return load_backend(str(tiny.hf(arch).path), settings=BackendSettings(**settings))


def _delta_net_state(config) -> tuple[int, int]:
    """A Gated DeltaNet layer's conv inputs (q, k and v) and recurrent state (a key-by-value
    matrix per value head), in elements."""
    conv = (config.linear_conv_kernel_dim - 1) * (
        2 * config.linear_num_key_heads * config.linear_key_head_dim
        + config.linear_num_value_heads * config.linear_value_head_dim
    )
    recurrent = (
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    )
    return conv, recurrent


def _mamba2_state(config) -> tuple[int, int]:
    """A Mamba-2 layer's conv inputs (x, then B and C per group) and SSM state (a state
    of d_state per channel of every head), in elements."""
    inner = config.mamba_n_heads * config.mamba_d_head
    conv = (config.mamba_d_conv - 1) * (inner + 2 * config.mamba_n_groups * config.mamba_d_state)
    return conv, inner * config.mamba_d_state


def _mamba1_state(config) -> tuple[int, int]:
    """A Mamba-1 layer's conv inputs (every channel) and SSM state (d_state per channel)."""
    inner = config.mamba_expand * config.hidden_size
    return (config.mamba_d_conv - 1) * inner, inner * config.mamba_d_state


# Each hybrid family's state per layer, from transformers' config of its tiny model.
STATE_ELEMENTS = {
    "qwen3_5": _delta_net_state,
    "qwen3_5_moe": _delta_net_state,
    "granitemoehybrid": _mamba2_state,
    "falcon_h1": _mamba2_state,
    "jamba": _mamba1_state,
}


def _state_bytes(tiny, arch) -> int:
    """A sequence's states, from transformers' config: every state layer's conv and
    recurrent state, in float32."""
    config = tiny.hf(arch).hf.config
    conv, recurrent = STATE_ELEMENTS[arch](config)
    layers = sum(config.layer_types.count(kind) for kind in ("linear_attention", "hybrid"))
    return layers * (conv + recurrent) * FLOAT32


def _kv_bytes_per_token(tiny, arch) -> int:
    """K and V of every attention layer for a token, from transformers' config."""
    config = tiny.hf(arch).hf.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = sum(config.layer_types.count(kind) for kind in ("full_attention", "hybrid"))
    return attention * 2 * config.num_key_value_heads * head_dim * FLOAT32


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_info_counts_the_state_a_sequence_keeps(tiny, arch):
    """A token budget (the default) sizes the KV blocks; the states come on top: the
    engine's 64 slots, each a live state and the copy it leaves for a snapshot, and the
    MISTRALRS_PREFIX_CACHE_N snapshots (16 by default)."""
    with _load(tiny, arch) as backend:
        info = backend.cache_info()
    per_seq = _state_bytes(tiny, arch)
    assert info.state_bytes_per_seq == per_seq
    assert (info.state_slots, info.state_snapshots, info.state_copies_per_slot) == (64, 16, 2)
    assert info.state_bytes == 64 * 2 * per_seq + 16 * per_seq
    assert info.num_blocks == 4096 // 32


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_a_byte_budget_is_shared_between_kv_blocks_and_states(tiny, arch):
    """MISTRALRS_PAGED_ATTN_MEMORY_MB=1: the snapshots take at most a quarter of it, the
    slots what half of it leaves (at most 64), the KV blocks the rest."""
    budget = MIB
    per_seq, slot = _state_bytes(tiny, arch), 2 * _state_bytes(tiny, arch)
    snapshots = min(16, budget // 4 // per_seq)
    slots = min(64, (budget // 2 - snapshots * per_seq) // slot)
    states = slots * slot + snapshots * per_seq
    with _load(tiny, arch, paged_attn_memory_mb=1) as backend:
        info = backend.cache_info()
    assert (info.state_slots, info.state_snapshots) == (slots, snapshots)
    assert info.state_bytes == states
    assert info.bytes_per_token == _kv_bytes_per_token(tiny, arch)
    assert info.num_blocks == (budget - states) // (32 * _kv_bytes_per_token(tiny, arch))
    assert states + info.num_blocks * 32 * info.bytes_per_token <= budget


def _one_at_a_time(tiny, arch) -> list[list[int]]:
    with _load(tiny, arch) as backend:
        return [
            backend.generate(p, max_tokens=TOKENS, temperature=0).token_ids
            for p in SHARED_PREFIX_PROMPTS
        ]


def _watch_slots(backend) -> list[int]:
    """The slots held after each admission, recorded as the engine runs."""
    states = engine_internals(backend).cache.states
    held, claim = [], states.claim

    def counted(seq, start=None):
        claim(seq, start)
        held.append(states.num_holders)

    states.claim = counted
    return held


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_sequences_wait_for_a_free_slot(tiny, arch):
    """Two slots and five prompts at once: three wait (no error, no preemption), each
    admitted as a slot frees, and every one gets the tokens it gets alone."""
    alone = _one_at_a_time(tiny, arch)
    with _load(tiny, arch) as backend:
        engine_internals(backend).cache.states.slots = 2
        held = _watch_slots(backend)
        results = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=TOKENS, temperature=0)
        stats = backend.stats()
    assert [r.token_ids for r in results] == alone
    assert max(held) == 2
    assert len(held) == len(SHARED_PREFIX_PROMPTS)
    assert stats.preemptions == 0
    assert (stats.states.slots, stats.states.in_use) == (2, 0)


def test_the_budgets_slots_bound_what_runs(tiny):
    """Granite's states under a 1 MB budget give 4 slots (see the budget test): five
    prompts run four at a time, with the tokens each gets alone."""
    arch = "granitemoehybrid"
    alone = _one_at_a_time(tiny, arch)
    with _load(tiny, arch, paged_attn_memory_mb=1) as backend:
        assert backend.cache_info().state_slots == 4
        held = _watch_slots(backend)
        results = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=TOKENS, temperature=0)
    assert [r.token_ids for r in results] == alone
    assert max(held) == 4


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_preemption_frees_the_slot(tiny, arch):
    """Two slots and a pool too small for both sequences' blocks: the newest is preempted,
    its slot freed for the next, and every prompt still gets its tokens."""
    alone = _one_at_a_time(tiny, arch)
    with _load(tiny, arch, paged_attn_context_len=128, paged_attn_block_size=16) as backend:
        engine_internals(backend).cache.states.slots = 2
        results = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=TOKENS, temperature=0)
        stats = backend.stats()
    assert stats.preemptions > 0
    assert stats.states.in_use == 0
    assert stats.cache_holders == 0
    assert [r.token_ids for r in results] == alone


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_snapshots_and_state_bytes_stay_within_their_bound(tiny, arch):
    """Blocks of 8 tokens leave a snapshot candidate every 8: more than the budget's
    bound, which holds after every step, and the bytes held never pass the plan's."""
    with _load(tiny, arch, paged_attn_memory_mb=1, paged_attn_block_size=8) as backend:
        info = backend.cache_info()
        cache = engine_internals(backend).cache
        seen, after_step = [], cache.after_step

        def watched(batch):
            after_step(batch)
            seen.append(cache.states.usage())

        cache.after_step = watched
        backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=TOKENS, temperature=0)
        backend.generate([p + " Again." for p in SHARED_PREFIX_PROMPTS], max_tokens=TOKENS)
        final = backend.stats().states
    per_seq = _state_bytes(tiny, arch)
    assert info.state_snapshots == min(16, MIB // 4 // per_seq)
    assert max(u.snapshots for u in seen) == info.state_snapshots  # filled, never passed
    assert max(u.bytes for u in seen) <= info.state_bytes
    assert final.snapshots == info.state_snapshots
    assert final.snapshot_bytes == info.state_snapshots * per_seq
    assert final.bytes == final.snapshot_bytes  # no sequence holds a state now


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_the_server_reports_the_state_group(tiny, arch):
    metrics = ServerMetrics()
    with _load(tiny, arch, paged_attn_block_size=8) as backend:
        backend.generate(SHARED_PREFIX_PROMPTS[0], max_tokens=TOKENS, temperature=0)
        metrics.watch(lambda: [(None, backend.stats())])
        text = generate_latest(metrics.registry).decode()
    samples = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    per_seq = _state_bytes(tiny, arch)
    assert float(samples["spnl_state_slots"]) == 64
    assert float(samples["spnl_state_slots_used"]) == 0
    snapshots = float(samples["spnl_state_snapshots"])
    assert snapshots >= 1
    assert float(samples["spnl_state_bytes"]) == snapshots * per_seq


def test_a_budget_too_small_for_one_slot_names_the_figures():
    """A large model's states (400 MB a sequence, two copies a slot) beside a 1000 MB
    budget, whose half (the state group's most) holds no slot."""
    asked = StatePlan(bytes_per_seq=400 * MIB, copies_per_slot=2, slots=64, snapshots=16)
    budget = KvBudget("memory_mb", 1000, explicit=True)
    with pytest.raises(SettingsError) as caught:
        fit_states(asked, budget, 1000 * MIB)
    message = str(caught.value)
    for figure in ("MISTRALRS_PAGED_ATTN_MEMORY_MB=1000", "500.00 MB", "838,860,800 bytes"):
        assert figure in message, message
    roomy = fit_states(asked, budget, 4000 * MIB)  # 1000 MB for snapshots: 2 of them
    assert (roomy.slots, roomy.snapshots) == (1, 2)


@pytest.mark.parametrize("paged", [True, False])
def test_states_that_do_not_fit_in_memory_are_refused_naming_them(tiny, monkeypatch, paged):
    """A token budget's blocks fit, but not the 64 slots' states beside them."""
    arch = "granitemoehybrid"
    monkeypatch.setattr(build, "available_memory", lambda device: STEP_RESERVE_BYTES + MIB)
    with pytest.raises(PlatformError) as caught:
        _load(tiny, arch, paged_attn=paged, paged_attn_context_len=64)
    per_seq = _state_bytes(tiny, arch)
    slots = "64 state slots x " + f"{(2 if paged else 1) * per_seq:,} bytes"
    assert slots in str(caught.value)


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_pic_settings_are_refused_at_load(tiny, arch):
    with pytest.raises(SettingsError, match="MISTRALRS_PIC_REUSE=tokens: PIC prompts cannot"):
        _load(tiny, arch, pic_reuse="tokens")


def _children() -> set[int]:
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    found.add(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_tensor_parallelism_is_refused_at_load(tiny, arch):
    """Two ranks asked: refused from the config before any rank starts."""
    before = _children()
    with pytest.raises(SettingsError, match=r"state layers .* are not split yet"):
        _load(tiny, arch, mn_local_world_size=2)
    assert _children() <= before
