"""Tensor parallelism on the CPU: local ranks over gloo on 127.0.0.1, each with a share of
the heads, the MLPs' rows and the vocabulary, against one process on the same weights."""

import os
import signal
import subprocess
import sys
import threading
import time
from functools import cache, partial

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import PROMPT, SHARED_PREFIX_PROMPTS, engine_internals, engine_logits, run_together
from tiny_models import ARCHITECTURES, MOE_ARCHITECTURES, write_adapter, write_gguf_adapter

from spnl_backend import BackendSettings, DistributedError, SettingsError, load_backend
from spnl_backend.distributed.sharding import Shard
from spnl_backend.distributed.tensor_parallel import TensorParallel
from spnl_backend.kernels.lora_ref import LoraPair, lora_delta_ref
from spnl_backend.loader.hf_config import read_text_config

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="local ranks on Linux")
TOKENS = 32
TIMEOUT_S = 20.0  # the collective timeout of these groups: what a failure waits at most
# Each rank sums its share of a row-parallel product, and the shares are summed across
# the ranks: float32 sums in another order, whose differences grow through the layers
# (up to 2e-4 seen on logits of magnitude 1-5 over 90 positions).
SUM_ORDER_ATOL = 1e-3


def _settings(world: int = 1, **extra) -> BackendSettings:
    if world > 1:
        extra = {"mn_local_world_size": world, "collective_timeout_s": TIMEOUT_S} | extra
    return BackendSettings(**({"device": "cpu", "prefix_cache_n": 0} | extra))


def _run(path, world: int, prompts=(PROMPT,), **extra):
    """Logits of the first prompt and every prompt's greedy tokens, then the backend closed."""
    with load_backend(str(path), settings=_settings(world, **extra)) as backend:
        ids = backend.tokenizer.encode(prompts[0])
        logits = engine_logits(backend, ids)
        results = backend.generate(list(prompts), max_tokens=TOKENS, temperature=0, ignore_eos=True)
        return logits, [r.token_ids for r in results]


@pytest.mark.parametrize("arch", [*ARCHITECTURES, *MOE_ARCHITECTURES])
def test_two_ranks_compute_what_one_process_does(tiny, arch):
    path = tiny.hf(arch).path
    logits, tokens = _run(path, 1)
    split_logits, split_tokens = _run(path, 2)
    torch.testing.assert_close(split_logits, logits, rtol=0, atol=SUM_ORDER_ATOL)
    assert split_tokens == tokens


@pytest.mark.parametrize("arch", [*ARCHITECTURES, *MOE_ARCHITECTURES])
def test_four_ranks_with_fewer_key_heads_than_ranks(tiny, arch):
    """The tiny models have 2 key/value heads: with 4 ranks each holds the one its query
    head reads (OLMoE's whole-projection k norm then counts each head once)."""
    path = tiny.hf(arch).path
    logits, tokens = _run(path, 1)
    split_logits, split_tokens = _run(path, 4)
    torch.testing.assert_close(split_logits, logits, rtol=0, atol=SUM_ORDER_ATOL)
    assert split_tokens == tokens


def test_a_quantized_gguf_splits_along_its_blocks(tiny):
    """Q8_0 blocks of 32: o and down are split by columns into whole blocks, never
    dequantized; the ranks compute what one process computes on the same blocks."""
    path = tiny.gguf("llama", GGMLQuantizationType.Q8_0)
    logits, tokens = _run(path, 1, SHARED_PREFIX_PROMPTS[:3])
    with load_backend(str(path), settings=_settings(2)) as backend:
        attention = backend.model.model.layers[0].self_attn
        assert attention.o_proj.weight_q.qtype == GGMLQuantizationType.Q8_0
        assert (attention.o_proj.in_features, attention.num_heads) == (32, 2)  # half of each
        split_logits = engine_logits(backend, backend.tokenizer.encode(PROMPT))
        results = backend.generate(
            SHARED_PREFIX_PROMPTS[:3], max_tokens=TOKENS, temperature=0, ignore_eos=True
        )
    torch.testing.assert_close(split_logits, logits, rtol=0, atol=SUM_ORDER_ATOL)
    assert [r.token_ids for r in results] == tokens


def test_prefix_hits_preemption_and_mixed_batches_keep_each_requests_tokens(tiny):
    """Rank 0 schedules: prefix-cache hits, preemption under a small pool and a batch of
    prompts of every length change no request's tokens, as in one process."""
    path = str(tiny.hf("qwen3").path)
    budget = {"paged_attn_block_size": 8, "paged_attn_context_len": 160, "prefix_cache_n": 16}
    expected = []
    with load_backend(path, settings=BackendSettings(device="cpu", **budget)) as one:
        for prompt in SHARED_PREFIX_PROMPTS:
            expected.append(one.generate(prompt, max_tokens=24, temperature=0).token_ids)
    settings = BackendSettings(
        device="cpu", mn_local_world_size=2, collective_timeout_s=TIMEOUT_S, **budget
    )
    with load_backend(path, settings=settings) as split:
        together = split.generate(SHARED_PREFIX_PROMPTS, max_tokens=24, temperature=0)
        again = split.generate(SHARED_PREFIX_PROMPTS, max_tokens=24, temperature=0)
        stats = split.stats()
    assert [r.token_ids for r in together] == expected
    assert [r.token_ids for r in again] == expected
    assert stats.preemptions > 0
    assert stats.prefix_cache_hits > 0


def test_a_speculative_draft_and_pic_prompts_under_tensor_parallelism(tiny):
    """The draft (the target under ISQ, whole on rank 0) proposes, the split target
    verifies; PIC prompts reuse their plus blocks' KV from every rank's pool. Each gives
    the tokens one process gives."""
    path = str(tiny.hf("llama").path)
    draft = {"speculative_draft_isq": "Q8_0", "speculative_gamma": 4}
    blocks = [
        ("cross", "Answer from these."),
        ("plus", "the cat sat on the mat"),
        ("plus", "the dog ran off"),
        ("cross", "What do they say?"),
    ]
    runs = []
    for world in (1, 2):
        with load_backend(path, settings=_settings(world, **draft)) as backend:
            speculated = backend.generate(PROMPT, max_tokens=TOKENS, temperature=0)
        with load_backend(path, settings=_settings(world, prefix_cache_n=16)) as backend:
            pic = [backend.generate(blocks=blocks, max_tokens=16, temperature=0) for _ in "ab"]
        runs.append((speculated, pic))
    (speculated, pic), (split_speculated, split_pic) = runs
    assert split_speculated.token_ids == speculated.token_ids
    assert split_speculated.usage.accepted_tokens > 0
    assert [r.token_ids for r in split_pic] == [r.token_ids for r in pic]
    assert split_pic[1].usage.pic_hit_tokens > 0


@pytest.mark.parametrize(
    "pool", [{"paged_cache_type": "f8e4m3"}, {"kv_cache_compression": "int8"}], ids=str
)
def test_an_fp8_or_compressed_pool_on_every_rank(tiny, pool):
    """Each rank calibrates its pool on its own heads in the same pass (an FP8 scale takes
    the largest magnitude of every rank's heads, as one process's does)."""
    path = tiny.hf("llama").path
    _, tokens = _run(path, 1, **pool)
    _, split_tokens = _run(path, 2, **pool)
    assert split_tokens == tokens


def test_the_server_answers_from_rank_0(tiny):
    from live_server import LiveServer

    path = str(tiny.hf("llama").path)
    with load_backend(path, settings=_settings(1)) as one:
        expected = one.generate("The capital of France is", max_tokens=8, temperature=0).text
    with load_backend(path, settings=_settings(2)) as split:
        server = LiveServer(split)
        try:
            client = server.client()
            answer = client.completions.create(
                model="tiny-llama", prompt="The capital of France is", max_tokens=8, temperature=0
            )
        finally:
            server.stop()
    assert answer.choices[0].text == expected


def _local_ranks(backend):
    """The processes rank 0 started (white box: for killing one)."""
    engine = engine_internals(backend)
    ranks = next(hook.__self__ for hook in engine.on_close if hasattr(hook, "__self__"))
    return ranks.local.processes


def test_a_rank_killed_mid_generation_fails_its_requests_within_the_timeout(tiny):
    path = str(tiny.hf("llama").path)
    backend = load_backend(path, settings=_settings(2, collective_timeout_s=5.0))
    processes = _local_ranks(backend)
    stream = backend.stream(PROMPT, max_tokens=4000, temperature=0, ignore_eos=True)
    next(iter(stream))
    processes[1].send_signal(signal.SIGKILL)
    # 4,000 tokens take minutes: the failure ends the stream long before it could.
    with pytest.raises(DistributedError, match=r"rank 1 \(pid \d+\) exited with signal 9"):
        for _ in stream:
            pass
    with pytest.raises(DistributedError, match="load a new backend"):
        backend.generate("x", max_tokens=2)
    backend.close()
    assert all(p.poll() is not None for p in processes.values())


_HOST = """
import sys, time
from spnl_backend import BackendSettings, load_backend
settings = BackendSettings(device="cpu", mn_local_world_size=2, collective_timeout_s=5)
backend = load_backend(sys.argv[1], settings=settings)
backend.generate("x", max_tokens=2)
print("ready", flush=True)
time.sleep(600)
"""


def test_the_other_ranks_end_when_rank_0_is_killed(tiny, tmp_path):
    path = str(tiny.hf("llama").path)
    host = subprocess.Popen(
        [sys.executable, "-c", _HOST, path], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert host.stdout.readline().strip() == "ready"
        children = _children(host.pid)
        assert children, "rank 0 started no other rank"
        host.send_signal(signal.SIGKILL)
        host.wait()
        deadline = time.monotonic() + 120  # the collective timeout is 5 s: generous
        while time.monotonic() < deadline and any(_alive(pid) for pid in children):
            time.sleep(0.2)
        alive = [pid for pid in children if _alive(pid)]
        assert not alive, f"ranks {alive} still alive 120 s after rank 0 was killed"
    finally:
        host.kill()


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


_FOLLOWER = "import sys; from spnl_backend import load_backend; load_backend(sys.argv[1])"


def _head_with_a_follower(path: str, head_env: dict, follower_env: dict) -> list[int]:
    """Rank 0 here (``head_env`` set while it loads and generates), the other rank a
    process whose load_backend follows it: rank 0's greedy tokens, once the other has
    ended its process cleanly on rank 0's close."""
    other = subprocess.Popen(
        [sys.executable, "-c", _FOLLOWER, path], env={**os.environ, **follower_env}
    )
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in head_env.items():
                patch.setenv(name, value)
            with load_backend(path) as backend:
                result = backend.generate(PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True)
        assert other.wait(30) == 0
    finally:
        other.kill()
    return result.token_ids


def test_torchrun_ranks_start_each_other(tiny):
    """Under torchrun every rank runs the same script: rank 0's load_backend returns the
    backend; every other rank's follows it and ends its process when rank 0 closes."""
    path = str(tiny.hf("llama").path)
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(_free_port()), "MISTRALRS_DEVICE": "cpu"}
    env |= {"MISTRALRS_PREFIX_CACHE_N": "0"}
    head = {**env, "RANK": "0", "MISTRALRS_COLLECTIVE_TIMEOUT_S": "20"}
    tokens = _head_with_a_follower(path, head, {**env, "RANK": "1"})
    _, expected = _run(tiny.hf("llama").path, 1)
    assert [tokens] == expected


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"mn_local_world_size": 8}, "cannot be split over 8 ranks: its 4 attention heads"),
        ({"mn_local_world_size": 3}, "must be a power of two"),
        ({"mn_local_world_size": 2, "paged_attn": False}, "paged attention is off"),
        ({"mn_local_world_size": 2, "no_nccl": True}, None),  # one process: loads
    ],
)
def test_settings_that_do_not_fit_are_refused_before_any_rank_starts(tiny, extra, message):
    path = str(tiny.hf("llama").path)
    before = _children(os.getpid())
    if message is None:
        with load_backend(path, settings=BackendSettings(device="cpu", **extra)) as backend:
            assert backend.generate("x", max_tokens=1).token_ids
        return
    with pytest.raises(SettingsError, match=message):
        load_backend(path, settings=BackendSettings(device="cpu", **extra))
    assert _children(os.getpid()) == before


def test_a_head_port_in_use_is_refused_before_any_rank_starts(tiny):
    import socket  # a port held, not a free one

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        settings = BackendSettings(
            device="cpu",
            mn_global_world_size=2,
            mn_local_world_size=1,
            mn_head_num_workers=1,
            mn_head_port=port,
        )
        with pytest.raises(SettingsError, match=f"port {port} cannot be listened on"):
            load_backend(str(tiny.hf("llama").path), settings=settings)


def test_threads_are_shared_out_and_given_back(tiny):
    before = torch.get_num_threads()
    seen = []
    with load_backend(str(tiny.hf("llama").path), settings=_settings(2)) as backend:
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        backend.generate("x", max_tokens=1)
    assert seen == [max(1, (os.cpu_count() or 1) // 2)]
    assert torch.get_num_threads() == before


def test_two_machines_with_mistral_rs_variables(tiny):
    """The MISTRALRS_MN_* set, both "machines" on 127.0.0.1: the head serves, the worker
    machine's load_backend follows it and ends its process when the head closes."""
    path = str(tiny.hf("qwen3").path)
    port = _free_port()
    common = {
        "MISTRALRS_MN_GLOBAL_WORLD_SIZE": "2",
        "MISTRALRS_MN_LOCAL_WORLD_SIZE": "1",
        "MISTRALRS_DEVICE": "cpu",
        "MISTRALRS_PREFIX_CACHE_N": "0",
        "MISTRALRS_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    head = {**common, "MISTRALRS_MN_HEAD_NUM_WORKERS": "1", "MISTRALRS_MN_HEAD_PORT": str(port)}
    worker = {
        **common,
        "MISTRALRS_MN_WORKER_SERVER_ADDR": f"127.0.0.1:{port}",
        "MISTRALRS_MN_WORKER_ID": "0",
    }
    tokens = _head_with_a_follower(path, head, worker)
    _, expected = _run(tiny.hf("qwen3").path, 1)
    assert [tokens] == expected


two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL, layer mapping)"
)


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_two_gpus_over_nccl_and_mapped_compute_what_one_gpu_does(tiny, arch):
    """Every visible GPU is a rank by default; MISTRALRS_NO_NCCL=1 maps the layers over
    them instead. Float32, so the tokens must match one GPU's."""
    path = str(tiny.hf(arch).path)
    base = {"dtype": "float32", "prefix_cache_n": 0, "collective_timeout_s": TIMEOUT_S}
    results = []
    for extra in ({"device": "cuda:0"}, {"device": "cuda"}, {"device": "cuda", "no_nccl": True}):
        with load_backend(path, settings=BackendSettings(**base, **extra)) as backend:
            results.append(
                backend.generate(PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True)
            )
    one, split, mapped = (r.token_ids for r in results)
    assert split == one
    assert mapped == one


def test_a_split_checks_the_dense_downs_beside_experts(tiny):
    """Qwen3-MoE keeps dense layers beside its experts: both kinds of down projection are
    cut by columns, so each must split into whole stored blocks."""
    import dataclasses

    from spnl_backend.distributed.sharding import check_shardable
    from spnl_backend.loader.hf_config import read_text_config

    config, _ = read_text_config(tiny.hf("qwen3_moe").path)
    moe = dataclasses.replace(config.moe, intermediate_size=512)
    wide = dataclasses.replace(config, intermediate_size=512, moe=moe)
    blocks = {"o": 1, "down": 256}.__getitem__  # float attention, k-quant downs
    check_shardable(wide, 2, blocks)  # 256 columns each: whole blocks
    narrow_dense = dataclasses.replace(wide, intermediate_size=256)
    with pytest.raises(SettingsError, match="down projection's 256 columns split 2 ways"):
        check_shardable(narrow_dense, 2, blocks)


def test_the_deviation_pick_is_refused_under_tensor_parallelism(tiny):
    """Its probe runs one rank's model alone: a clear error at load, not a failed step."""
    settings = _settings(2, pic_recompute=0.2, pic_recompute_select="deviation")
    with pytest.raises(SettingsError, match="MISTRALRS_PIC_RECOMPUTE_SELECT=deviation"):
        load_backend(str(tiny.hf("llama").path), settings=settings)


@pytest.fixture(scope="module")
def lora_runs(tiny, tmp_path_factory):
    """The tiny Llama with a PEFT adapter "one" loaded at start and a GGUF adapter "two"
    (q and k rows in llama.cpp's order) loaded at run time, on ``world`` ranks: the greedy
    tokens of a base, a "one" and a "two" request sharing steps, then of "one" unloaded
    and loaded again, and of "two" alone; and what speculation the default (auto) ran."""
    root = tmp_path_factory.mktemp("tp-lora")
    tiny_model = tiny.hf("llama")
    write_adapter(root / "one", tiny_model.hf, seed=1)
    pairs = write_adapter(root / "peft-two", tiny_model.hf, seed=2, rank=8)
    two = write_gguf_adapter(root / "two.gguf", "llama", pairs, alpha=8.0)

    @cache
    def run(world: int):
        settings = _settings(world, lora_adapters=f"one={root / 'one'}")
        with load_backend(str(tiny_model.path), settings=settings) as backend:
            backend.load_adapter("two", str(two))

            def greedy(adapter):
                result = backend.generate(
                    PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True, adapter=adapter
                )
                return result.token_ids

            together = run_together(backend, *[partial(greedy, a) for a in (None, "one", "two")])
            backend.unload_adapter("one")
            backend.load_adapter("one", str(root / "one"))
            return (together, greedy("one"), greedy("two")), backend.speculation()

    return run


@pytest.mark.parametrize("world", [2, 4])
def test_lora_adapters_split_as_the_projections_they_attach_to(lora_runs, world):
    """lora_B split by rows on q, k, v, gate and up, lora_A by columns on o and down (each
    rank's partial product summed with the base's by the same all-reduce; with 4 ranks,
    key/value heads held twice): the ranks give one process's greedy tokens, adapters
    loaded at start and at run time, unloaded and loaded again. The default speculation
    runs in one process and not under tensor parallelism, where it would refuse the
    adapters."""
    one_process, alone = lora_runs(1)
    assert len({tuple(tokens) for tokens in one_process[0]}) == 3  # each adapter changes them
    split, choice = lora_runs(world)
    assert split == one_process
    assert alone.method == "ngram"
    assert choice.method is None
    assert "under tensor parallelism speculation runs without LoRA adapters" in choice.why


def test_lora_shares_add_up_to_the_whole_product(tiny):
    """Column-parallel shares (q, k, up) side by side, and row-parallel ones (o, down) summed
    over the ranks' input columns, give the whole adapter's product."""
    config, _ = read_text_config(tiny.hf("llama").path)
    gen = torch.Generator().manual_seed(0)
    layer = "model.layers.1."
    for world in (2, 4):
        shards = [Shard(config, rank, world) for rank in range(world)]
        for module, (inputs, outputs) in {
            "self_attn.q_proj": (64, 64),
            "self_attn.k_proj": (64, 32),
            "mlp.up_proj": (64, 128),
            "self_attn.o_proj": (64, 64),
            "mlp.down_proj": (128, 64),
        }.items():
            name = layer + module
            pair = LoraPair(
                torch.randn(4, inputs, generator=gen), torch.randn(outputs, 4, generator=gen), 0.5
            )
            x = torch.randn(3, inputs, generator=gen)
            whole = lora_delta_ref(x, pair.a, pair.b, pair.scale)
            shares = [shard.lora_share(name, pair) for shard in shards]
            if module in ("self_attn.o_proj", "mlp.down_proj"):
                columns = [shard.cut(f"{name}.weight", x) for shard in shards]
                parts = [
                    lora_delta_ref(c, s.a, s.b, s.scale)
                    for c, s in zip(columns, shares, strict=True)
                ]
                torch.testing.assert_close(sum(parts), whole)
                local = (inputs // world, outputs)
            else:
                parts = [lora_delta_ref(x, s.a, s.b, s.scale) for s in shares]
                held = len({s.b.data_ptr() for s in shares})  # each rank's own copy
                assert held == world
                if module == "self_attn.k_proj" and world == 4:  # a head held by 2 ranks
                    torch.testing.assert_close(torch.cat(parts[::2], dim=-1), whole)
                    local = (inputs, outputs // 2)
                else:
                    torch.testing.assert_close(torch.cat(parts, dim=-1), whole)
                    local = (inputs, outputs // world)
            assert (shares[0].a.shape[1], shares[0].b.shape[0]) == local
            assert shards[0].whole_features(name, *local) == (inputs, outputs)


def test_the_other_ranks_hear_the_net_change_to_the_adapters():
    """Rank 0's attaches and detaches since the others last heard, less an adapter attached
    and detached in between (which they never held)."""
    tp = TensorParallel(group=None, kv_replicas=1, drives=True, heartbeat_s=1.0)  # type: ignore[arg-type]
    one, two = object(), object()
    tp.lora_attached(0, one)  # type: ignore[arg-type]
    tp.lora_detached(0)
    assert tp.adapter_changes == []  # never sent: nothing to tell
    tp.lora_attached(0, one)  # type: ignore[arg-type]
    tp.adapter_changes = []  # as sent before a step
    tp.lora_detached(0)
    tp.lora_attached(0, two)  # type: ignore[arg-type]
    tp.lora_attached(1, one)  # type: ignore[arg-type]
    tp.lora_detached(0)
    assert tp.adapter_changes == [(0, None), (1, one)]
