"""docs/coverage.md is the table the family registry gives now (`coverage_table`)."""

from coverage_table import PAGE, mechanisms, table

from spnl_backend.models.arch import FAMILIES


def test_the_coverage_page_is_current():
    assert PAGE.read_text() == table(), "docs/coverage.md is stale: python tests/coverage_table.py"


def test_every_family_has_a_row_and_mechanisms():
    from coverage_table import _row
    from tiny_models import build_tokenizer

    vocab = len(build_tokenizer())
    rows = [_row(f, vocab) for f in FAMILIES]
    assert len(rows) == len(FAMILIES)
    assert all(row.split(" | ")[3].strip() for row in rows)  # no family without mechanisms
    assert all(f"| {f.name} |" in PAGE.read_text() for f in FAMILIES)


def test_mechanisms_tell_families_apart():
    """Different mechanisms give different rows: Llama's plain layers against DeepSeek's
    latent attention and Jamba's Mamba-1 (a check that the column reads the descriptions)."""
    from tiny_models import build_tokenizer, hf_config

    from spnl_backend.loader.hf_config import model_config_from_hf

    vocab = len(build_tokenizer())
    of = {
        a: mechanisms(model_config_from_hf(hf_config(a, vocab)))
        for a in ("llama", "deepseek_v3", "jamba")
    }
    assert "latent attention (MLA)" in of["deepseek_v3"]
    assert "latent attention (MLA)" not in of["llama"]
    assert "Mamba1" in of["jamba"]
    assert "Mamba1" not in of["llama"]
