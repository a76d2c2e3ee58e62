"""The KV tier (`engine.kv_tier`): blocks written to disk as the pool registers them and
read back where the pool misses: after an eviction, after a restart, from another
process; the same bits as a pool hit and as recomputing; every corruption a miss; a full
or read-only disk the tier off; a writer killed mid-write leaving nothing a reader takes."""

import errno
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import PROMPT, engine_internals, greedy_with_logits

from spnl_backend import BackendSettings, load_backend
from spnl_backend.engine.kv_tier import SUFFIX, KvTier, TierEntry
from spnl_backend.errors import SettingsError

BLOCK = 16
DOCS = [
    "Once upon a time there was a little model that could.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
]
LONG = " ".join([PROMPT] * 3)  # several full blocks


def _settings(tier: Path | None, **extra) -> BackendSettings:
    if tier is not None:
        extra["kv_tier_dir"] = str(tier)
    return BackendSettings(device="cpu", paged_attn_block_size=BLOCK, **extra)


def _load(path: str, tier: Path | None, **extra):
    return load_backend(path, settings=_settings(tier, **extra))


def _logits_and_tokens(backend, prompt=None, blocks=None, tokens=12):
    """Greedy tokens, the first token's logits and the usage of one request."""
    if blocks is not None:
        return greedy_with_logits(backend, tokens, blocks=blocks)
    return greedy_with_logits(backend, tokens, prompt=prompt)


def _flush(backend) -> None:
    engine_internals(backend).cache.tier.tier.flush()


def _entries(root: Path) -> list[Path]:
    return sorted(root.glob(f"*/*{SUFFIX}"))


def _pieces(backend, docs):
    encode = backend.tokenizer.encode_plain
    return [
        ("cross", backend.tokenizer.encode("") + encode("Read these.")),
        *[("plus", encode(doc)) for doc in docs],
        ("cross", encode("Now answer.")),
    ]


@pytest.fixture(scope="module")
def trained(tiny):
    return str(tiny.trained().path)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"paged_cache_type": "f32"},
        {"paged_cache_type": "f8e4m3"},
        {"kv_cache_compression": "int8"},
    ],
    ids=["f16", "f32", "fp8", "int8-records"],
)
def test_a_restart_reads_the_prefix_back_exactly(trained, tmp_path, extra):
    with _load(trained, tmp_path, **extra) as first:
        cold_tokens, _cold_logits, cold = _logits_and_tokens(first, LONG)
        warm_tokens, warm_logits, warm = _logits_and_tokens(first, LONG)
        _flush(first)
    assert cold.cached_tokens == 0
    assert warm.cached_tokens > 0
    assert warm.tier_hit_tokens == 0
    assert _entries(tmp_path)
    with _load(trained, tmp_path, **extra) as second:
        tokens, logits, usage = _logits_and_tokens(second, LONG)
        stats = second.stats()
    assert usage.cached_tokens == warm.cached_tokens
    assert usage.tier_hit_tokens == usage.cached_tokens
    assert torch.equal(logits, warm_logits)  # the same bits as a pool hit
    assert tokens == warm_tokens == cold_tokens
    assert stats.tier.hits == usage.tier_hit_tokens // BLOCK
    assert stats.tier_hit_tokens == usage.tier_hit_tokens
    with _load(trained, None, **extra) as plain:  # and as recomputing, without a tier
        assert _logits_and_tokens(plain, LONG)[0] == tokens


def test_codecs_that_learn_from_the_first_vectors_run_without_the_tier(trained, tmp_path, caplog):
    # PolarQuant's anchors are set by what this process stores first: its records would
    # mean something else to another process.
    with _load(trained, tmp_path, kv_cache_compression="tq4") as backend:
        tokens, _, _ = _logits_and_tokens(backend, LONG)
        assert backend.stats().tier is None
    assert "kv_tier.off" in caplog.text
    assert "anchors" in caplog.text
    assert tokens


def test_reads_start_when_the_request_arrives_on_the_reader_thread(trained, tmp_path, monkeypatch):
    with _load(trained, tmp_path) as first:
        _logits_and_tokens(first, LONG)
    readers = []
    real_fetch = KvTier.fetch

    def fetch(self, *args):
        readers.append(threading.current_thread().name)
        return real_fetch(self, *args)

    monkeypatch.setattr(KvTier, "fetch", fetch)
    with _load(trained, tmp_path) as second:
        _, _, usage = _logits_and_tokens(second, LONG)
    assert usage.tier_hit_tokens > 0
    assert readers
    assert all(name.startswith("kv-tier-read") for name in readers)  # not the engine's


def test_evicted_blocks_come_back_from_the_tier(trained, tmp_path):
    # A pool of 20 blocks: the second prompt evicts the first's cached blocks.
    with _load(trained, tmp_path, paged_attn_context_len=20 * BLOCK) as backend:
        expected, _, _ = _logits_and_tokens(backend, LONG)
        other = " ".join(["A completely different text about caches and blocks."] * 6)
        _logits_and_tokens(backend, other)
        _flush(backend)
        tokens, _, usage = _logits_and_tokens(backend, LONG)
    assert usage.tier_hit_tokens > 0
    assert tokens == expected


def test_pic_elements_and_prefix_blocks_together(trained, tmp_path):
    with _load(trained, tmp_path) as first:
        pieces = _pieces(first, DOCS)
        cold_tokens, cold_logits, cold = _logits_and_tokens(first, blocks=pieces)
        _logits_and_tokens(first, LONG)
        _flush(first)
    with _load(trained, tmp_path) as second:
        tokens, logits, usage = _logits_and_tokens(second, blocks=pieces)
        _prefix_tokens, _, prefix = _logits_and_tokens(second, LONG)
    plus = sum(len(ids) for kind, ids in pieces if kind == "plus")
    assert cold.pic_miss_tokens == plus
    assert usage.pic_hit_tokens > 0
    assert usage.tier_hit_tokens >= usage.pic_hit_tokens
    assert torch.equal(logits, cold_logits)
    assert tokens == cold_tokens
    assert prefix.tier_hit_tokens > 0


def _corrupt_each(entries: list[Path], how: str, other: Path | None) -> None:
    for entry in entries:
        data = bytearray(entry.read_bytes())
        if how == "truncated":
            data = data[: len(data) // 2]
        elif how == "flipped":
            data[-100] ^= 0x10
        elif how == "other model's file":
            data = bytearray(other.read_bytes())  # another model's entry, another size
        elif how == "other fingerprint":
            data[8:40] = bytes(range(32))  # the same size, another model's fingerprint
        elif how == "position":
            data[48] ^= 0x01  # the stored position (a PIC block's), outside the payload
        entry.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated": "size",
    "flipped": "checksum",
    "other model's file": "size",
    "other fingerprint": "fingerprint",
    "position": "checksum",
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_a_corrupt_entry_is_a_miss_never_a_wrong_answer(trained, tiny, tmp_path, how):
    other = None
    if how == "other model's file":  # a llama of other weights: its entries' bytes
        with _load(str(tiny.hf("llama").path), tmp_path / "other") as stranger:
            _logits_and_tokens(stranger, LONG)
            _flush(stranger)
        other = _entries(tmp_path / "other")[0]
    with _load(trained, tmp_path / "tier") as first:
        expected, expected_logits, _ = _logits_and_tokens(first, LONG)
        _flush(first)
    _corrupt_each(_entries(tmp_path / "tier"), how, other)
    with _load(trained, tmp_path / "tier") as second:
        tokens, logits, usage = _logits_and_tokens(second, LONG)
        stats = second.stats()
    assert usage.tier_hit_tokens == 0
    assert tokens == expected
    assert torch.equal(logits, expected_logits)
    assert stats.tier.rejected.get(CORRUPTIONS[how], 0) >= 1
    with _load(trained, tmp_path / "tier") as third:  # removed, then written again
        tokens, _, usage = _logits_and_tokens(third, LONG)
    assert usage.tier_hit_tokens > 0
    assert tokens == expected


def test_another_dtypes_entries_are_not_read(trained, tmp_path):
    with _load(trained, tmp_path, paged_cache_type="f32") as first:
        _logits_and_tokens(first, LONG)
        _flush(first)
    with _load(trained, tmp_path) as second:  # float16 blocks: another fingerprint
        _, _, usage = _logits_and_tokens(second, LONG)
    assert usage.tier_hit_tokens == 0
    assert len({p.parent for p in _entries(tmp_path)}) == 2


def test_a_read_only_directory_turns_the_tier_off_and_answers_go_on(trained, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    with _load(trained, tmp_path) as backend:
        directory = engine_internals(backend).cache.tier.tier.dir
        directory.chmod(0o500)
        try:
            tokens, _, _ = _logits_and_tokens(backend, LONG)
            _flush(backend)
            assert backend.stats().tier.enabled is False
            assert _logits_and_tokens(backend, LONG)[0] == tokens
        finally:
            directory.chmod(0o700)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["full", "read-only"])
def test_a_full_or_read_only_disk_turns_the_tier_off(trained, tmp_path, monkeypatch, code):
    real_open = os.open

    def refused(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and str(path).endswith(".tmp"):  # the writer's entries alone
            raise OSError(code, os.strerror(code))
        return real_open(path, flags, *args, **kwargs)

    with _load(trained, tmp_path) as backend:
        monkeypatch.setattr(os, "open", refused)
        tokens, _, _ = _logits_and_tokens(backend, LONG)
        _flush(backend)
        monkeypatch.undo()
        assert backend.stats().tier.enabled is False
        assert not _entries(tmp_path)
        assert _logits_and_tokens(backend, LONG)[0] == tokens


def test_a_budget_smaller_than_an_entry_writes_nothing_and_a_small_one_evicts(tmp_path):
    fingerprint = bytes(32)
    tiny = KvTier(tmp_path, 100, fingerprint)
    tiny.offer(TierEntry(1, (1, 2), None, torch.zeros(1000, dtype=torch.uint8)))
    tiny.flush()
    assert tiny.stats().rejected == {"over_budget": 1}
    assert not list(tmp_path.glob(f"*/*{SUFFIX}"))
    tiny.close()
    small = KvTier(tmp_path, 3500, fingerprint)  # room for three entries of about 1 KB
    for key in range(1, 6):
        small.offer(TierEntry(key, (key,), None, torch.full((1000,), key, dtype=torch.uint8)))
        small.flush()
        time.sleep(0.01)  # distinct modification times: the oldest go first
    assert small.stats().evictions == 2
    assert small.fetch(1, (1,), 1000) is None
    five = torch.full((1000,), 5, dtype=torch.uint8)
    assert torch.equal(small.fetch(5, (5,), 1000).payload, five)
    small.close()


def test_an_entry_is_checked_against_the_key_tokens_and_size(tmp_path):
    tier = KvTier(tmp_path, 1 << 20, bytes(32))
    block = torch.arange(64, dtype=torch.uint8)

    def put() -> None:
        tier.offer(TierEntry(7, (1, 2, 3), 40, block))
        tier.flush()

    put()
    entry = tier.fetch(7, (1, 2, 3), 64)
    assert entry.position == 40
    assert torch.equal(entry.payload, block)
    reused = bytearray(KvTier.entry_size(3, 64))
    again = tier.fetch(7, (1, 2, 3), 64, reused)
    assert again.buffer is reused  # read into the memory given
    assert torch.equal(again.payload, block)
    assert tier.fetch(7, (1, 2, 3), 64, bytearray(10)).buffer is not None  # a fresh one
    assert tier.fetch(8, (1, 2, 3), 64) is None  # no entry
    assert tier.fetch(7, (1, 2, 4), 64) is None  # other tokens under the same key
    put()  # a refused entry was removed: written again
    assert tier.fetch(7, (1, 2, 3), 32) is None  # another pool's block size
    assert tier.stats().rejected == {"key": 1, "size": 1}
    assert tier.stats().misses == 1
    tier.close()


def test_a_file_that_is_not_an_entry_is_refused_before_it_is_read(tmp_path):
    tier = KvTier(tmp_path, 1 << 20, bytes(32))
    os.mkfifo(tier.dir / f"{9:016x}{SUFFIX}")  # opening it for reading would block
    (tier.dir / f"{10:016x}{SUFFIX}").symlink_to("/dev/zero")
    with open(tier.dir / f"{11:016x}{SUFFIX}", "wb") as huge:
        huge.truncate(1 << 40)  # sparse: a terabyte that costs nothing on disk
    for key in (9, 10, 11):
        assert tier.fetch(key, (1,), 64) is None
    assert tier.stats().rejected == {"not_a_file": 1, "unreadable": 1, "size": 1}
    tier.close()


def _slow_writer(directory: str, ready) -> None:
    """A writer that dies between writing half an entry and renaming it."""
    import spnl_backend.engine.kv_tier as kv_tier

    real_replace = os.replace

    def stall(source, target):
        ready.set()
        time.sleep(60)
        real_replace(source, target)

    kv_tier.os.replace = stall
    tier = KvTier(Path(directory), 1 << 20, bytes(32))
    tier.offer(TierEntry(9, (1,), None, torch.ones(4096, dtype=torch.uint8)))
    time.sleep(60)


def test_a_writer_killed_mid_write_leaves_no_entry(tmp_path):
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=_slow_writer, args=(str(tmp_path), ready))
    child.start()
    assert ready.wait(60)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert list(tmp_path.glob("*/.*.tmp"))  # what it left
    tier = KvTier(tmp_path, 1 << 20, bytes(32))
    assert tier.fetch(9, (1,), 4096) is None
    tier.close()


def _serve_and_exit(path: str, directory: str, prompt: str, out) -> None:
    with _load(path, Path(directory)) as backend:
        result = _logits_and_tokens(backend, prompt)
        _flush(backend)
    out.put((result[0], result[2].tier_hit_tokens))


def test_two_processes_share_one_directory(trained, tmp_path):
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    prompts = [LONG, LONG + " And one more sentence about the fox."]
    children = [
        context.Process(target=_serve_and_exit, args=(trained, str(tmp_path), p, out))
        for p in prompts
    ]
    for child in children:
        child.start()
    results = [out.get(timeout=300) for _ in children]
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    with _load(trained, tmp_path) as third:
        answers = [_logits_and_tokens(third, p) for p in prompts]
    assert all(usage.tier_hit_tokens > 0 for _, _, usage in answers)
    assert sorted(tokens for tokens, _ in results) == sorted(t for t, _, _ in answers)


def test_the_settings_name_a_directory(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SettingsError, match=r"MISTRALRS_KV_TIER_DIR.*not a directory"):
        BackendSettings(kv_tier_dir=str(tmp_path / "file"))
    with pytest.raises(SettingsError, match="MISTRALRS_KV_TIER_MB"):
        BackendSettings(kv_tier_mb=0)
    assert BackendSettings(kv_tier_dir=str(tmp_path / "new")).kv_tier_dir.endswith("new")
