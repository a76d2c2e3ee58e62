"""bench/real_sizes.py's pure parts: arguments, tables, the ISA line; no engine runs."""

import json
import re
import sys
from pathlib import Path

import pytest
from fake_llama_bench import fake_llama_bench

# The bench scripts import their siblings (`harness`, `decode`) as top-level modules, as
# they do when run as `python bench/real_sizes.py`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import harness, real_sizes

OURS = {
    "decode_tok_s": 5.0,
    "prefill_tok_s": 100.0,
    "ttft_ms": 40.0,
    "peak_rss_mb": 1234.0,
    "load_s": 2.5,
}


def cells(line: str) -> list[str]:
    """A markdown row's cells (an escaped pipe stays inside its cell)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


PLAN = {"file_bytes": 2_000_000_000, "weight_bytes": 1_000_000_000, "kv_values_per_token": 1000}


def test_defaults(monkeypatch, tmp_path):
    monkeypatch.setattr(real_sizes.os, "cpu_count", lambda: 8)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = real_sizes.parse_args([])
    assert args.shapes == ["llama-1b", "gemma3-4b", "llama-8b"]
    assert args.formats == ["q4_k_m"]
    assert args.threads == [1, 2, 8]
    assert args.runs == 1
    assert args.batched == [4, 16]
    assert args.contexts == [4096, 16384]
    assert args.dir == tmp_path / "spnl_backend" / "bench-gguf"
    assert (args.skip_long, args.skip_batched, args.default_model, args.child) == (0, 0, 0, None)
    assert not args.skip_invariance_cost
    monkeypatch.setattr(real_sizes.os, "cpu_count", lambda: 2)
    assert real_sizes.parse_args([]).threads == [1, 2]
    assert real_sizes.parse_args(["--threads", "4", "2", "4"]).threads == [2, 4]


def test_single_table_with_a_not_run_row():
    llama = OURS | {"decode_tok_s": 2.5, "prefill_tok_s": 200.0}
    rows = [
        {"model": "m", "threads": 2, "spnl-backend": OURS, "llama.cpp": llama},
        {"model": "m", "threads": 4, "spnl-backend": OURS, "llama.cpp": {"error": "a | b"}},
    ]
    bandwidths = {2: {"gb_s": 10.0}, 4: {"error": "killed"}}  # bound at 2 threads: 10 tok/s
    lines = real_sizes.single_table(rows, {"m": PLAN}, bandwidths).splitlines()
    assert lines[0].count("|") == len(real_sizes.SINGLE_HEADER) + 1
    ok, failed = cells(lines[2]), cells(lines[3])
    assert ok[:8] == ["m, 2.0 GB", "2", "5.0", "50%", "100", "40 ms", "1,234 MB", "2.5 s"]
    assert ok[8:10] == ["2.5", "25%"]
    assert ok[-2:] == ["2.00x", "0.50x"]
    assert len(failed) == len(real_sizes.SINGLE_HEADER)
    assert failed[3] == "n/a"  # no bandwidth measured at 4 threads
    assert failed[8] == "not run: a \\| b"  # escaped: a pipe would split the cell
    assert failed[-2:] == ["n/a", "n/a"]


def test_batched_and_long_tables():
    batched = [
        {"model": "a", "result": {"single": {"tok_s": 10.0}, "batches": {"4": {"tok_s": 30.0}}}},
        {"model": "b", "result": {"error": "no llama"}},
    ]
    text = real_sizes.batched_table(batched)
    assert "| a | 4 | 30.0 | 10.0 | 3.00x | not run: not measured | | | n/a |" in text
    assert "| b | | not run: no llama | | | not run: not measured | | | n/a |" in text
    batched[0]["llama"] = {"single": {"tok_s": 8.0}, "batches": {"4": {"tok_s": 20.0}}}
    text = real_sizes.batched_table(batched[:1])
    assert "| a | 4 | 30.0 | 10.0 | 3.00x | 20.0 | 8.0 | 2.50x | 1.50x |" in text
    runs = {
        "long-paged": {"decode_tok_s": 6.0, "prompt_tokens": 4031},
        "long-contiguous": {"error": "needs about 9.0 GB"},
        "long-paged-f32": {"decode_tok_s": 5.0, "prompt_tokens": 4031},
        "long-llama": {"decode_tok_s": 4.0, "prompt_tokens": 4029},
    }
    text = real_sizes.long_table([{"model": "a", "context": 4096, "runs": runs}])
    expected = "| a | 4096 | 4029 / 4031 | 6.0 | not run: needs about 9.0 GB | 5.0 | 4.0 | 1.50x |"
    assert expected in text


def test_isa_line():
    cpuinfo = (
        "processor\t: 0\nmodel name\t: Xeon X\nflags\t\t: fpu avx2 avx512f amx_int8\n\n"
        "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu avx512_vnni\n"
    )
    assert real_sizes.isa_line(cpuinfo) == (
        "CPU: Xeon X; ISA: avx2 avx512f amx_int8 (absent: avx512_vnni avx512_bf16)"
    )
    assert "ISA: none of avx2" in real_sizes.isa_line("flags : fpu sse2\n")


def test_long_context_memory_estimate():
    need = real_sizes.long_need_bytes(PLAN, 4096, "long-llama")
    assert need == PLAN["file_bytes"] + 2 * 1000 * (4096 + 64) + 2**30
    paged = real_sizes.long_need_bytes(PLAN, 4096, "long-paged")
    assert real_sizes.long_need_bytes(PLAN, 4096, "long-paged-f32") - paged == paged - (
        PLAN["file_bytes"] + 2**30
    )  # float32 K/V: twice float16's
    assert real_sizes.fit_error(need, need) is None
    assert real_sizes.fit_error(need, None) is None
    assert "needs about" in real_sizes.fit_error(need, need - 1)
    assert real_sizes.meminfo_available("MemTotal: 9 kB\nMemAvailable: 3 kB\n") == 3072


def test_context_prompt_repeats_the_text():
    def words(text: str) -> list[str]:
        return text.split()

    prompt = harness.context_prompt(words, 10_000)  # the text is ~4,100 words
    assert 9_950 <= len(words(prompt)) <= 10_000


def test_invariance_table():
    off = OURS | {"decode_tok_s": 4.0, "prefill_tok_s": 200.0}
    rows = [
        {"model": "a", "spnl-backend": OURS, real_sizes.VARIANT: off},
        {"model": "b", "spnl-backend": OURS, real_sizes.VARIANT: {"error": "killed"}},
    ]
    text = real_sizes.invariance_table(rows)
    assert "| a | decode tok/s | 5.0 | 4.0 | 1.25x |" in text
    assert "| a | prefill tok/s | 100.0 | 200.0 | 0.50x |" in text
    assert "| b | | not run: killed |" in text


def test_ours_runs_with_and_without_invariance(monkeypatch):
    seen = []

    def run_child(engine, python, path, threads, runs):
        seen.append(real_sizes.os.environ.get(real_sizes.INVARIANCE_VAR))
        return {"engine": engine} | OURS

    monkeypatch.setattr(real_sizes.decode, "run_child", run_child)
    monkeypatch.delenv(real_sizes.INVARIANCE_VAR, raising=False)
    model = real_sizes.Model("m", Path("m.gguf"))
    real_sizes.ours_single(model, 2, 1)
    real_sizes.ours_single(model, 2, 1, invariant=False)
    assert seen == ["true", "false"]
    assert real_sizes.INVARIANCE_VAR not in real_sizes.os.environ


def test_batched_bench_command_and_output(tmp_path):
    command = real_sizes.batched_bench_command(Path("bb"), tmp_path / "m.gguf", [4, 16], 2)
    assert command[command.index("-npl") + 1] == "1,4,16"
    assert command[command.index("-t") + 1] == "2"
    assert command[command.index("-ntg") + 1] == str(real_sizes.harness.DECODE_TOKENS)
    lines = [
        "main: n_kv_max = 2304",
        '{"pl": 1, "speed_tg": 20.5, "speed_pp": 100.0}',
        '{"pl": 16, "speed_tg": 61.0, "speed_pp": 300.0}',
    ]
    parsed = real_sizes.parse_batched_bench("\n".join(lines))
    assert parsed == {"single": {"tok_s": 20.5}, "batches": {"16": {"tok_s": 61.0}}}
    with pytest.raises(ValueError, match="1 sequence"):
        real_sizes.parse_batched_bench(lines[2])


def test_a_missing_batched_bench_is_a_not_run_cell(tmp_path):
    result = real_sizes.llama_batched(tmp_path / "absent", tmp_path / "m.gguf", [16], 2)
    assert "absent" in result["error"]


# ---- the table against llama-bench ----------------------------------------------------------

BENCH_BIN = "/tmp/llama-bench"  # a name only: the runner is replaced or played by a script


def test_llama_bench_arguments(monkeypatch):
    args = real_sizes.parse_args(["--llama-bench", BENCH_BIN, "--wait-quiet", "0.5"])
    assert args.llama_bench == Path(BENCH_BIN)
    assert args.wait_quiet == 0.5
    assert not args.skip_profile
    assert real_sizes.parse_args([]).llama_bench is None
    assert real_sizes.parse_args([]).wait_quiet is None


def test_a_single_row_runs_llama_bench_at_the_thread_count_with_the_loads(tmp_path, monkeypatch):
    binary = fake_llama_bench(tmp_path, prefill_ts=80.0, decode_ts=4.0)
    loads = iter([0.25, 0.75])
    monkeypatch.setattr(real_sizes.harness, "load_average", lambda: next(loads))
    monkeypatch.setattr(real_sizes.decode, "run_child", lambda *a: {"engine": "ours"} | OURS)
    args = real_sizes.parse_args(
        ["--llama-bench", str(binary), "--runs", "2", "--skip-invariance-cost"]
    )
    row = real_sizes.single_sequence(args, real_sizes.Model("m", tmp_path / "m.gguf"), 1)
    (call,) = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    options = {call[i]: call[i + 1] for i in range(0, len(call) - 1, 2)}
    assert options == {"-m": str(tmp_path / "m.gguf"), "-t": "1", "-p": "1024", "-n": "128"} | {
        "-r": "2",
        "-o": "json",
    }
    llama = row[real_sizes.LLAMA]
    assert (llama["prefill_tok_s"], llama["decode_tok_s"], llama["load_avg"]) == (80.0, 4.0, 0.75)
    assert llama["peak_rss_mb"] > 0  # /usr/bin/time's line, read
    assert row[real_sizes.OURS]["load_avg"] == 0.25
    assert real_sizes.llama_bench_line(binary, [row]).startswith(f"llama.cpp: {binary}, build 7")


def test_a_missing_llama_bench_is_a_not_run_cell(tmp_path):
    args = real_sizes.parse_args(["--llama-bench", str(tmp_path / "absent")])
    model = real_sizes.Model("m", tmp_path / "m.gguf")
    assert "error" in real_sizes.llama_single(args, model, 2)


PROFILE = {"token_ms": 20.0, "products_ms": 16.0, "products_bytes": 0.8e9, "tokens": 16}


def test_products_figures_from_a_profile():
    profile = {
        "tokens": 16,
        "blocks_ms_per_token": 20.0,
        "parts": {
            "product 2048+512 x 2048 (Q4_K)": {"ms": 10.0, "calls": 16.0, "gb_s": 50.0},
            "product 128256 x 2048 (Q6_K)": {"ms": 6.0, "calls": 1.0, "gb_s": 50.0},
            "attention": {"ms": 2.0, "calls": 16.0, "gb_s": None},
        },
    }
    assert real_sizes.products_figures(profile) == PROFILE


@pytest.mark.parametrize(
    ("share", "profile", "expected"),
    [
        (0.86, None, "bandwidth (≥85% of the bound)"),
        (0.5, None, "below the bound (not profiled)"),
        (0.5, {"error": "killed"}, "not run: killed"),
        # 0.8 GB at 100 GB/s: 8 ms; the products take 16 (8 over), 4 ms outside them
        (0.5, PROFILE, "compute: products 16.0 of 20.0 ms (that token at 50% of the bound)"),
        # 0.8 GB at 50 GB/s: 16 ms, all of the products' time; 4 ms outside them
        (0.5, PROFILE | {"products_bytes": 1.6e9}, "overhead: products 16.0 of 20.0 ms"),
        (0.5, PROFILE | {"token_ms": 15.0}, "unclear (the profile's two runs disagree"),
    ],
)
def test_what_limits_decode(share, profile, expected):
    cell = real_sizes.limit_cell(share, profile, {"gb_s": 100.0}, 100.0)
    assert cell.startswith(expected)
    if profile and "error" not in profile:
        rate = profile["products_bytes"] / 16e6
        assert f"read at {rate:.1f} GB/s ({rate / 100:.0%} of the bandwidth)" in cell
    assert real_sizes.limit_cell(None, PROFILE, {"gb_s": 100.0}, 100.0) == "n/a"


def test_the_llama_bench_table_sets_each_figure_beside_its_target():
    ours = OURS | {"decode_tok_s": 6.0, "prefill_tok_s": 140.0, "load_avg": 0.1}
    ours["decode_tokens"] = 129
    llama = {"decode_tok_s": 5.0, "prefill_tok_s": 100.0, "load_avg": 0.2}
    rows = [
        {"model": "m", "threads": 1, "spnl-backend": ours, "llama.cpp": llama},
        {"model": "m", "threads": 2, "spnl-backend": ours | {"decode_tok_s": 9.5}}
        | {"llama.cpp": {"error": "a | b", "load_avg": 0.3}},
        {"model": "m", "threads": 4, "spnl-backend": ours | {"decode_tokens": 40}}
        | {"llama.cpp": llama},
    ]
    # 0.8 GB read at 10 GB/s takes 80 ms: the products are 80 ms over, 40 ms outside them
    rows[0]["profile"] = {"token_ms": 200.0, "products_ms": 160.0, "products_bytes": 0.8e9}
    bandwidths = {1: {"gb_s": 10.0}, 2: {"gb_s": 10.0}}  # bound: 10 tok/s
    lines = real_sizes.llama_bench_table(rows, {"m": PLAN}, bandwidths).splitlines()
    assert lines[0].count("|") == len(real_sizes.LLAMA_BENCH_HEADER) + 1
    one, two, four = (cells(line) for line in lines[2:])
    assert one[:7] == [
        "m, 2.0 GB",
        "1",
        "6.0 / 5.0",
        "1.20x (target ≥1.20x: met)",
        "10.0",
        "60% (target ≥90%: not met)",
        "50%",
    ]
    assert one[7] == (
        "compute: products 160.0 of 200.0 ms (that token at 50% of the bound), read at "
        "5.0 GB/s (50% of the bandwidth); 40.0 ms outside them"
    )
    assert one[8:] == ["140 / 100", "1.40x (target ≥1.50x: not met)", "0.10 / 0.20"]
    assert two[0] == "m, 2.0 GB (llama-bench: a \\| b)"
    assert two[2:7] == ["9.5 / -", "n/a", "10.0", "95% (target ≥90%: met)", "n/a"]
    assert two[7] == "bandwidth (≥85% of the bound)"
    assert two[9:] == ["n/a", "0.10 / 0.30"]
    assert four[0] == "m, 2.0 GB (ours stopped at EOS after 40 tokens)"
    assert four[4:8] == ["n/a"] * 4  # no bandwidth measured at 4 threads


def test_only_rows_below_the_bandwidth_share_are_profiled(monkeypatch):
    seen = []

    def child(python, mode, *arguments):
        seen.append((mode, *arguments))
        return dict(PROFILE)

    monkeypatch.setattr(real_sizes, "child", child)
    monkeypatch.setattr(real_sizes.harness, "load_average", lambda: 0.5)
    model = real_sizes.Model("m", Path("m.gguf"))
    rows = [
        {"model": "m", "threads": t, "spnl-backend": OURS | {"decode_tok_s": rate}}
        for t, rate in ((1, 8.0), (2, 9.0), (4, 1.0))
    ]
    args = real_sizes.parse_args(["--llama-bench", BENCH_BIN])
    bandwidths = {1: {"gb_s": 10.0}, 2: {"gb_s": 10.0}, 4: {"error": "killed"}}
    real_sizes.limit_profiles(args, rows, [model], {"m": PLAN}, bandwidths)
    assert seen == [("profile", "--gguf", Path("m.gguf"), "--threads", 1)]
    assert rows[0]["profile"] == PROFILE | {"load_avg": 0.5}
    assert "profile" not in rows[1]
    assert "profile" not in rows[2]


LABELS = ["llama-1b q4_k_m", "gemma3-1b q4_k_m", "llama-8b q4_k_m", "gemma3-270m q4_k_m (default)"]


def test_batched_and_long_runs_take_the_models_named():
    files = [real_sizes.Model(label, Path(f"{i}.gguf")) for i, label in enumerate(LABELS)]
    assert real_sizes.chosen(files, None) == files
    assert [m.label for m in real_sizes.chosen(files, ["270m", "llama-1b"])] == [
        "llama-1b q4_k_m",
        "gemma3-270m q4_k_m (default)",
    ]
    args = real_sizes.parse_args(["--batched-models", "270m", "llama-1b"])
    assert args.batched_models == ["270m", "llama-1b"]


def test_the_bound_names_each_bandwidth_its_load_and_how_it_was_read():
    native = {"gb_s": 20.0, "load_avg": 0.5, "method": real_sizes.read_bound.NATIVE}
    bandwidths = {1: native, 2: {"error": "killed"}}
    text = real_sizes.bound_sentence({"m": PLAN}, bandwidths)
    assert text == (
        "Bound: weight bytes per token (m 1,000 MB) over the measured read bandwidth "
        "(1 threads 20.0 GB/s (load avg at start 0.50), 2 threads not run: killed, "
        "measured by bench/read_bound.c)."
    )
    bandwidths[2] = {"gb_s": 30.0, "method": real_sizes.read_bound.TORCH_SUM}
    text = real_sizes.bound_sentence({"m": PLAN}, bandwidths)
    assert text.endswith("measured by a torch sum, no C compiler found and bench/read_bound.c).")


def test_the_bandwidth_is_measured_at_each_thread_count_of_the_table(monkeypatch):
    asked = []

    def read_bandwidth(threads):
        asked.append(threads)
        return {"gb_s": 10.0 * threads, "method": real_sizes.read_bound.NATIVE}

    monkeypatch.setattr(real_sizes.read_bound, "read_bandwidth", read_bandwidth)
    monkeypatch.setattr(real_sizes.harness, "load_average", lambda: 0.5)

    def in_process(command):  # the child's own function, run here
        assert command[command.index("--child") + 1] == "bandwidth"
        args = real_sizes.parse_args([str(part) for part in command[2:]])
        return real_sizes.CHILDREN[args.child](args)

    monkeypatch.setattr(real_sizes.harness, "run_json_child", in_process)
    found = real_sizes.bounds([1, 2])
    assert asked == [1, 2]
    assert found[2] == {"gb_s": 20.0, "method": real_sizes.read_bound.NATIVE, "load_avg": 0.5}
