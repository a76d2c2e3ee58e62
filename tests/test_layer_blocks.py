"""The native layer blocks (`models.native_blocks`) against their twin, the per-op path:
the same bits for every architecture they run (experts and OLMoE's attention included),
prefill and decode, both float pools; the per-op path wherever a step or a model is not
theirs."""

import pytest
import torch
from helpers import SHARED_PREFIX_PROMPTS, engine_internals, engine_logits
from tiny_models import ARCHITECTURES, KV_GROUP_ARCHITECTURES, MOE_ARCHITECTURES, PER_OP_ONLY

from spnl_backend import BackendSettings, load_backend
from spnl_backend.errors import EngineError
from spnl_backend.kernels.cpu import KernelArgumentError


def _load(tiny, arch, cache_type):
    settings = BackendSettings(device="cpu", isq="Q8_0", paged_cache_type=cache_type)
    return load_backend(str(tiny.hf(arch).path), settings=settings)


def _generate(backend, blocks: bool):
    backend.model.model.use_layer_blocks = blocks
    ids = backend.tokenizer.encode(SHARED_PREFIX_PROMPTS[0])
    logits = engine_logits(backend, ids)
    results = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=12, temperature=0)
    return logits, [r.text for r in results]


@pytest.mark.parametrize("cache_type", ["f16", "f32"])
@pytest.mark.parametrize("arch", [*ARCHITECTURES, *MOE_ARCHITECTURES, *KV_GROUP_ARCHITECTURES])
def test_the_blocks_give_the_per_op_paths_bits(tiny, arch, cache_type, block_runs):
    with _load(tiny, arch, cache_type) as per_op, _load(tiny, arch, cache_type) as blocks:
        expected_logits, expected_texts = _generate(per_op, blocks=False)
        assert block_runs[0] == 0
        logits, texts = _generate(blocks, blocks=True)
    if arch in PER_OP_ONLY:
        assert block_runs[0] == 0
    else:
        assert block_runs[0] > 0
    assert torch.equal(logits, expected_logits)
    assert texts == expected_texts


@pytest.mark.parametrize(
    "setting",
    [
        {"paged_attn": False},  # the contiguous cache
        {"batch_invariant": False},  # many rows take torch's GEMM
        {"paged_cache_type": "f8e4m3"},  # a pool the native kernels do not read
        {"cpu_kernels": "torch"},  # no native kernels at all
    ],
    ids=lambda setting: "-".join(f"{k}={v}" for k, v in setting.items()),
)
def test_a_step_that_is_not_theirs_takes_the_per_op_path(tiny, block_runs, setting):
    settings = BackendSettings(device="cpu", isq="Q8_0", **setting)
    with load_backend(str(tiny.hf("llama").path), settings=settings) as backend:
        backend.generate("The capital of France is", max_tokens=4, temperature=0)
    assert block_runs[0] == 0


def test_pools_refused_by_the_blocks_leave_every_layer_on_the_pools_it_had(tiny):
    settings = BackendSettings(device="cpu", isq="Q8_0")
    with load_backend(str(tiny.hf("llama").path), settings=settings) as backend:
        before = backend.generate("The capital of France is", max_tokens=8, temperature=0)
        blocks = backend.model.model._blocks
        pools = engine_internals(backend).cache.cache.layers
        num_slots = pools[0][0].shape[0] * pools[0][0].shape[1]
        bad = [tuple(t.clone() for t in pair) for pair in pools]
        bad[1] = tuple(t.to(torch.bfloat16) for t in bad[1])  # refused, after layer 0
        with pytest.raises(KernelArgumentError, match=r"a pool of torch\.bfloat16"):
            blocks.stack._set_pools(bad, num_slots)
        del bad
        after = backend.generate("The capital of France is", max_tokens=8, temperature=0)
    assert after.text == before.text


def test_olmoe_clamps_q_k_and_v_alike_on_both_paths(tiny, block_runs):
    """OLMoE's clip (q, k and v clamped after the whole-projection norms), tight enough
    to bite: the blocks clamp as the per-op path does."""
    runs = []
    for clip, blocks in ((None, False), (0.5, False), (0.5, True)):
        with _load(tiny, "olmoe", "f32") as backend:
            for layer in backend.model.model.layers:  # before the first step builds them
                layer.self_attn.clip_qkv = clip
            runs.append(_generate(backend, blocks=blocks))
    (free, _), (clipped, texts), (in_blocks, block_texts) = runs
    assert block_runs[0] > 0
    assert not torch.allclose(free, clipped, atol=1e-3)  # the clip changed something
    assert torch.equal(in_blocks, clipped)
    assert block_texts == texts


def test_a_failing_layer_in_the_one_call_names_its_block_and_layer(tiny):
    settings = BackendSettings(device="cpu", isq="Q8_0")
    with load_backend(str(tiny.hf("llama").path), settings=settings) as backend:
        before = backend.generate("The capital of France is", max_tokens=8, temperature=0)
        stack = backend.model.model._blocks.stack
        inner = stack.layers[1].inner
        stack.layers[1].inner = 0  # set in the array the one call takes: layer 1 refuses it
        try:
            with pytest.raises(EngineError, match=r"attention_block \(layer 1\) rejected"):
                backend.generate("The capital of France is", max_tokens=2, temperature=0)
        finally:
            stack.layers[1].inner = inner
        after = backend.generate("The capital of France is", max_tokens=8, temperature=0)
    assert after.text == before.text


def test_decode_steps_keep_their_buffers_and_pools_and_a_prefill_chunk_does_not(tiny):
    settings = BackendSettings(device="cpu", isq="Q8_0")
    with load_backend(str(tiny.hf("llama").path), settings=settings) as backend:
        backend.generate("The capital of France is", max_tokens=2, temperature=0)
        stack = backend.model.model._blocks.stack
        buffers = stack._buffers
        steps: list[tuple[int, list]] = []

        def recorded(tokens: int):
            addresses, held = buffers(tokens)
            steps.append((tokens, held))
            return addresses, held

        stack._buffers = recorded
        backend.generate("The capital of Spain is", max_tokens=6, temperature=0)
        assert [tokens for tokens, _ in steps] == [steps[0][0], 1, 1, 1, 1, 1]
        assert steps[0][0] > 1  # the prompt's prefill
        first = steps[1][1]
        for _, held in steps[2:]:  # every later decode step: the first one's buffers
            assert all(a is b for a, b in zip(held, first, strict=True))
        pools = engine_internals(backend).cache.cache.layers
        assert all(k is c() for (k, _), (c, _) in zip(pools, stack.pools_seen[2], strict=True))
        long = " ".join(["word"] * 80)
        stack._buffers = buffers
        backend.generate(long, max_tokens=1, temperature=0)  # an 80-token prefill, last
        assert stack.kept is None
