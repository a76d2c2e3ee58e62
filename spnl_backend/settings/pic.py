"""The sentinel token ids of raw-token PIC prompts: spnl's ``SPNL_PIC_PLUS_TOKEN`` and
``SPNL_PIC_CROSS_TOKEN`` (not ``MISTRALRS_*``: spnl sets them for every engine it drives);
and the rules by which plus elements are reused."""

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import SettingsError, shown

PLUS_SENTINEL_ENV, CROSS_SENTINEL_ENV = "SPNL_PIC_PLUS_TOKEN", "SPNL_PIC_CROSS_TOKEN"
# How a plus element's blocks are keyed in the pool (`engine.pic_blocks`): by everything
# before its group (exact), by its first position (relaxed), or by its tokens alone
# (tokens: spnl's rule; a hit elsewhere has its keys moved to where it now stands).
REUSE_RULES = ("exact", "relaxed", "tokens")
# Which tokens of a reused group are recomputed (`pic.layout`): each element's first ones,
# or the group's whose K/V deviate most from a full-attention pass (`engine.pic_probe`).
RECOMPUTE_SELECTIONS = ("first", "deviation")


@dataclass(frozen=True)
class PicSentinels:
    """The token ids that open plus and cross spans in raw-token prompts."""

    plus: int
    cross: int

    def check_vocabulary(self, vocab_size: int) -> None:
        for name, token in ((PLUS_SENTINEL_ENV, self.plus), (CROSS_SENTINEL_ENV, self.cross)):
            if token >= vocab_size:
                raise SettingsError(
                    f"{name}={token}: expected a token id from 0 to {vocab_size - 1} "
                    "(the model's vocabulary)"
                )


def pic_sentinels(environ: Mapping[str, str] | None = None) -> PicSentinels | None:
    """Both variables set (decimal ids, different), or neither (None); empty is unset."""
    environ = os.environ if environ is None else environ
    raw = {name: environ.get(name, "").strip() for name in (PLUS_SENTINEL_ENV, CROSS_SENTINEL_ENV)}
    given = [name for name, value in raw.items() if value]
    if not given:
        return None
    if len(given) == 1:
        missing = CROSS_SENTINEL_ENV if given[0] == PLUS_SENTINEL_ENV else PLUS_SENTINEL_ENV
        raise SettingsError(f"{given[0]} is set but {missing} is not: set both, or neither")
    ids = {}
    for name, value in raw.items():
        if not value.isascii() or not value.isdecimal():
            raise SettingsError(f"{name}={shown(value)}: expected a token id (a number >= 0)")
        ids[name] = int(value)
    if ids[PLUS_SENTINEL_ENV] == ids[CROSS_SENTINEL_ENV]:
        raise SettingsError(
            f"{PLUS_SENTINEL_ENV} and {CROSS_SENTINEL_ENV} are both {ids[PLUS_SENTINEL_ENV]}: "
            "they must be different token ids"
        )
    return PicSentinels(ids[PLUS_SENTINEL_ENV], ids[CROSS_SENTINEL_ENV])
