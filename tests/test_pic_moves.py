"""spnl's reuse rule (``tokens``): a plus element keyed by its tokens alone, hit wherever it
stands; a hit computed at other positions has its keys moved there (rotated on by the
difference, `engine.kv_shift`) into blocks of the request's own, the pooled blocks left
as they are."""

from types import SimpleNamespace

import pytest
import torch
from helpers import engine_internals

from spnl_backend import BackendSettings, load_backend
from spnl_backend.engine.kv_shift import KeyShift
from spnl_backend.kernels.paged_ref import FP8_MAX, copy_block_rotated, to_cache
from spnl_backend.models.config import RopeConfig
from spnl_backend.models.rope import RotaryEmbedding
from spnl_backend.request import sampling_params

BLOCK = 16
ROPES = [
    RopeConfig(theta=10_000.0, rotary_dim=32),
    RopeConfig(theta=500_000.0, rotary_dim=16),  # partial: the rest passes through
    RopeConfig(theta=500_000.0, rotary_dim=32, kind="llama3", factor=8.0,
               original_max_position=256),
    RopeConfig(theta=10_000.0, rotary_dim=32, kind="yarn", factor=4.0,
               original_max_position=128),
    RopeConfig(theta=10_000.0, rotary_dim=32, kind="linear", factor=2.0),
]  # fmt: skip


def _one_layer(rope: RopeConfig, max_position: int) -> SimpleNamespace:
    """What `KeyShift` reads of a model of one attention layer rotated by ``rope``."""
    layer = SimpleNamespace(kv_layer=0, mixer=SimpleNamespace(rope="global"))
    return SimpleNamespace(
        rope=rope, rope_local=None, layers=[layer], max_position_embeddings=max_position
    )


def _stored(keys: torch.Tensor, rope: RopeConfig, first: int, dtype, scale: float):
    """``keys [block, heads, 32]`` rotated for positions ``first ...`` and stored."""
    tables = RotaryEmbedding(rope, 4096)(torch.arange(first, first + keys.shape[0]), torch.float32)
    rotated = tables.apply(keys)
    if dtype == torch.float8_e4m3fn:
        rotated = (rotated / scale).clamp(-FP8_MAX, FP8_MAX)
    return to_cache(rotated, dtype)


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: f"{r.kind}-{r.rotary_dim}")
@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, 1e-4), (torch.float16, 4e-3), (torch.float8_e4m3fn, 0.15)],
)
@pytest.mark.parametrize(("first", "delta"), [(1, 150), (300, -200), (0, 3000)])
def test_moved_keys_are_the_keys_of_the_new_positions(rope, dtype, tolerance, first, delta):
    torch.manual_seed(first)
    keys = torch.randn(BLOCK, 2, 32)
    scale = float(keys.abs().max()) / 224
    pool = torch.zeros(3, BLOCK, 2, 32, dtype=dtype)
    values = torch.zeros(3, BLOCK, 2, 32, dtype=dtype)
    pool[0] = _stored(keys, rope, first, dtype, scale)
    values[0] = to_cache(torch.randn(BLOCK, 2, 32), dtype) if dtype != torch.float8_e4m3fn else 1
    config = _one_layer(rope, 4096)
    ((cos, sin),) = KeyShift(config, lambda *_: None).angles(delta)
    copy_block_rotated(pool, values, 0, 1, cos, sin, scale)
    expected = _stored(keys, rope, first + delta, dtype, scale).float()
    moved = pool[1].float()
    assert torch.equal(values[1], values[0])
    error = (moved - expected).abs().max() * (scale if dtype == torch.float8_e4m3fn else 1)
    assert error <= tolerance * float(keys.abs().max())


def test_a_longrope_shift_across_its_original_context_is_refused():
    rope = RopeConfig(
        theta=10_000.0, rotary_dim=32, kind="longrope", original_max_position=64,
        short_factor=(1.0,) * 16, long_factor=(2.0,) * 16,
    )  # fmt: skip
    config = _one_layer(rope, 256)
    shift = KeyShift(config, lambda *_: None)
    assert shift.possible(0, 32, 16)
    assert not shift.possible(0, 60, 16)


def _backend(path, **extra):
    exact = {"paged_cache_type": "f32", "cpu_matmul": "float32", "paged_attn_block_size": BLOCK}
    return load_backend(path, settings=BackendSettings(device="cpu", **exact, **extra))


@pytest.fixture
def moves(monkeypatch):
    """Each block move: (source, target, delta)."""
    seen = []
    original = KeyShift.move

    def record(self, sources, targets, delta):
        seen.extend((src, dst, delta) for src, dst in zip(sources, targets, strict=True))
        original(self, sources, targets, delta)

    monkeypatch.setattr(KeyShift, "move", record)
    return seen


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: two rotations, by layer
def test_an_element_computed_elsewhere_is_moved_and_the_pool_keeps_its_own(tiny, moves, arch):
    with _backend(str(tiny.hf(arch).path), pic_reuse="tokens") as backend:
        encode = backend.tokenizer.encode_plain
        words = encode(" ".join(["caches and blocks and prefixes"] * 20))
        doc, question = words[:40], words[40:52]
        backend.generate(blocks=[("cross", words[60:63]), ("plus", doc)], max_tokens=1)
        pool = engine_internals(backend).cache.cache
        before = [(k.clone(), v.clone()) for k, v in pool.layers]
        usage = backend.generate(
            blocks=[("cross", words[70:90]), ("plus", doc), ("cross", question)], max_tokens=1
        ).usage
        assert usage.pic_hit_tokens == len(doc)
        assert len(moves) == -(-len(doc) // BLOCK)
        assert {delta for _, _, delta in moves} == {17}  # 20 cross tokens where there were 3
        shift = engine_internals(backend).cache.shift
        for layer, (keys, values) in enumerate(pool.layers):
            for src, dst, delta in moves:
                assert torch.equal(keys[src], before[layer][0][src])  # the pool's own, unchanged
                expected_k, expected_v = before[layer][0].clone(), before[layer][1].clone()
                cos, sin = shift.angles(delta)[layer]
                copy_block_rotated(expected_k, expected_v, src, dst, cos, sin)
                assert torch.equal(keys[dst], expected_k[dst])
                assert torch.equal(values[dst], values[src])


def test_the_same_position_needs_no_move_and_local_positions_never_do(tiny, moves):
    path = str(tiny.hf("llama").path)
    with _backend(path, pic_reuse="tokens", pic_positions="local") as backend:
        words = backend.tokenizer.encode_plain(" ".join(["Numbers: 0 1 2 3 4 5"] * 20))
        doc = words[:40]
        backend.generate(blocks=[("cross", words[50:53]), ("plus", doc)], max_tokens=1)
        usage = backend.generate(
            blocks=[("cross", words[60:80]), ("plus", doc), ("cross", words[80:85])], max_tokens=1
        ).usage
    assert usage.pic_hit_tokens == len(doc)
    assert moves == []


def test_a_hit_that_cannot_move_is_computed_as_the_exact_rule_computes_it(tiny, moves):
    path = str(tiny.hf("llama").path)
    with _backend(path, pic_reuse="tokens") as backend, _backend(path) as exact:
        engine_internals(backend).cache.shift = None  # as under tensor parallelism
        words = backend.tokenizer.encode_plain(" ".join(["Tokens, tokens everywhere"] * 20))
        doc = words[:40]
        second = [("cross", words[60:80]), ("plus", doc), ("cross", words[80:90])]
        backend.generate(blocks=[("cross", words[50:53]), ("plus", doc)], max_tokens=1)
        moved = backend.generate(blocks=second, max_tokens=8, temperature=0)
        cold = exact.generate(blocks=second, max_tokens=8, temperature=0)
    assert moved.usage.pic_hit_tokens == 0
    assert moved.usage.pic_miss_tokens == len(doc)
    assert moved.token_ids == cold.token_ids


def test_the_rules_never_share_keys(tiny):
    """An element computed under one rule is not found under another: their roots differ."""
    path = str(tiny.hf("llama").path)
    with _backend(path) as backend:
        words = backend.tokenizer.encode_plain(" ".join(["the capital of France"] * 20))
        pieces = [("cross", words[:5]), ("plus", words[5:45]), ("cross", words[45:50])]
        backend.generate(blocks=pieces, max_tokens=1)
        request = backend.submit([backend._pic.from_pieces(pieces, "tokens")], sampling_params(1))
        for _ in request.items():
            pass
        assert request.seqs[0].num_pic_hit_tokens == 0


def test_a_completion_after_a_group_is_reusable_as_an_element(tiny, moves):
    """spnl's nested generates: a completion comes back in a later query as an assistant
    message, whose tokens are the generation's; its full blocks come from the pool."""
    path = str(tiny.hf("llama").path)
    with _backend(path, pic_reuse="tokens") as backend:
        words = backend.tokenizer.encode_plain(" ".join(["caches and blocks"] * 30))
        head = words[:32]  # a whole number of blocks before the completion
        first = [("cross", words[40:43]), ("plus", words[43:60]), ("cross", head)]
        completion = backend.generate(blocks=first, max_tokens=40, temperature=0, ignore_eos=True)
        element = head + completion.token_ids
        later = [("cross", words[60:70]), ("plus", element), ("cross", words[80:84])]
        usage = backend.generate(blocks=later, max_tokens=1).usage
    full = len(element) // BLOCK * BLOCK
    assert usage.pic_hit_tokens == full
    assert moves
