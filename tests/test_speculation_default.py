"""The default speculation (MISTRALRS_SPECULATIVE_METHOD=auto, `settings.speculation`): the
draft where one is set, else n-gram lookup wherever speculation can run, else none, with
the reason in `Backend.speculation()`, the load's `speculative.method` event, the server's
info and `spnl-backend info`; an explicit ngram is still refused where it cannot run (tensor
parallelism's case runs end to end in test_tensor_parallel's LoRA test)."""

import logging
from pathlib import Path

import pytest
from helpers import engine_internals
from test_compression import plugin  # noqa: F401  (the "raw" compression plugin)

from spnl_backend import BackendSettings, RequestError, SettingsError, load_backend
from spnl_backend.cli import _info_json
from spnl_backend.engine.ngram import NgramRunner
from spnl_backend.engine.speculative import SpeculativeRunner
from spnl_backend.server.router_info import server_info
from spnl_backend.settings import detect_platform
from spnl_backend.settings.speculation import choose_speculation

COPYING = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the"]
FREE = ["Once upon a time"]
TOKENS = 24


def load(path: Path, **settings):
    return load_backend(str(path), settings=BackendSettings(device="cpu", **settings))


def _chosen(caplog) -> list[dict]:
    """The fields of each `speculative.method` event logged."""
    return [
        r.spnl_fields
        for r in caplog.records
        if getattr(r, "spnl_event", None) == "speculative.method"
    ]


@pytest.fixture(scope="module")
def trained(tiny):
    return tiny.trained().path


def test_auto_is_ngram_on_a_plain_model_with_the_tokens_of_none(trained, caplog):
    with caplog.at_level(logging.INFO, logger="spnl_backend"):
        auto = load(trained)
    choice = auto.speculation()
    assert choice.method == "ngram"
    assert "METHOD=auto, no draft is set" in choice.why
    assert isinstance(engine_internals(auto).runner, NgramRunner)
    assert _chosen(caplog) == [{"method": "ngram", "why": choice.why}]
    assert server_info("m", auto, None)["speculation"] == {"method": "ngram", "why": choice.why}
    none = load(trained, speculative_method="none")
    assert none.speculation().method is None
    prompts = COPYING + FREE
    got = auto.generate(prompts, max_tokens=TOKENS, temperature=0)
    want = none.generate(prompts, max_tokens=TOKENS, temperature=0)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert got[0].usage.accepted_tokens > 0  # the copying prompt took proposals
    assert sum(r.usage.draft_tokens for r in want) == 0


def test_auto_is_the_draft_where_one_is_set(tiny):
    backend = load(tiny.hf("llama").path, speculative_draft_isq="Q8_0", speculative_gamma=4)
    choice = backend.speculation()
    assert (choice.method, choice.why) == (
        "draft",
        "MISTRALRS_SPECULATIVE_METHOD=auto, and a draft is set",
    )
    assert isinstance(engine_internals(backend).runner, SpeculativeRunner)


def test_auto_is_none_on_caches_that_cannot_drop_tokens(plugin, trained, caplog):  # noqa: F811
    """A compression plugin's non-paged caches without truncate: auto runs without
    speculation and says why; ngram asked for is refused with the reason."""
    with caplog.at_level(logging.INFO, logger="spnl_backend"):
        backend = load(trained, kv_cache_compression="raw")
    choice = backend.speculation()
    assert choice.method is None
    assert "COMPRESSION=raw cannot drop rejected tokens" in choice.why
    assert _chosen(caplog) == [{"method": "none", "why": choice.why}]
    assert backend.generate(COPYING[0], max_tokens=8, temperature=0).usage.draft_tokens == 0
    with pytest.raises(RequestError, match=r"without speculation \(.*cannot drop rejected"):
        backend.generate(COPYING[0], max_tokens=8, speculative=4)
    with pytest.raises(SettingsError, match=r"raw cannot be combined .* \(ngram\)"):
        load(trained, kv_cache_compression="raw", speculative_method="ngram")


def test_auto_is_none_under_tensor_parallelism():
    """Speculation there would take the LoRA adapters away (`engine.build`); ngram asked
    for runs, and is refused with adapters named (test_lora)."""
    choice = choose_speculation(
        BackendSettings(), tensor_parallel=True, state_layers=False, cache_rolls_back=True
    )
    assert choice.method is None
    assert "under tensor parallelism speculation runs without LoRA adapters" in choice.why
    asked = BackendSettings(speculative_method="ngram")
    explicit = choose_speculation(
        asked, tensor_parallel=True, state_layers=False, cache_rolls_back=True
    )
    assert explicit == type(choice)("ngram", "MISTRALRS_SPECULATIVE_METHOD=ngram")


@pytest.mark.parametrize(
    ("settings", "method"),
    [
        ({}, "ngram"),
        ({"speculative_method": "none"}, "none"),
        ({"speculative_method": "suffix"}, "suffix"),
        ({"speculative_draft_isq": "Q8_0"}, "draft"),
    ],
)
def test_info_says_what_auto_resolves_to(settings, method):
    settings = BackendSettings(device="cpu", **settings)
    shown = _info_json(settings, detect_platform(settings))["speculation"]
    assert shown["method"] == method
    assert "MISTRALRS_SPECULATIVE_METHOD=" in shown["why"]


def test_gamma_and_ngram_sizes_take_effect_under_auto():
    """They size the n-gram lookup auto runs: not reported as settings without effect."""
    from spnl_backend.settings.effects import ineffective_settings

    given = BackendSettings(device="cpu", speculative_gamma=8, speculative_ngram_max=6)
    assert ineffective_settings(given, detect_platform(given)) == []
    off = BackendSettings(device="cpu", speculative_method="none", speculative_gamma=8)
    assert [v for v, _ in ineffective_settings(off, detect_platform(off))] == [
        "MISTRALRS_SPECULATIVE_GAMMA"
    ]


def test_auto_is_none_on_a_model_with_state_layers(tiny):
    """There speculation keeps 2 x (gamma + 1) more states per running sequence: auto runs
    none and says so; ngram asked for runs, with those states planned in the budget."""
    path = tiny.hf("qwen3_5").path
    auto = load(path)
    choice = auto.speculation()
    assert choice.method is None
    assert "the model has state layers, where speculation keeps 34 more states" in choice.why
    assert auto.cache_info().state_copies_per_slot == 2  # the live state and a snapshot's
    asked = load(path, speculative_method="ngram", speculative_gamma=3)
    assert asked.speculation().method == "ngram"
    assert asked.cache_info().state_copies_per_slot == 2 + 2 * 4
