"""bench/pic_accuracy.py's pure parts: questions whose answers are in their documents."""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pytest

from bench import pic_accuracy


@pytest.mark.parametrize(("hops", "seed"), [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (2, 3)])
def test_a_question_has_its_answer_in_the_documents_and_needs_hops_of_them(hops, seed):
    asked = pic_accuracy.question(6, 80, hops, random.Random(seed))
    assert asked.hops == hops
    assert len(asked.docs) == 6
    holding = [doc for doc in asked.docs if asked.truth in doc]
    assert holding  # the answer is there
    if hops == 1:
        place = asked.question.removeprefix("What is the code of the vault of ").rstrip("?")
        fact = f"The vault of {place} opens with the code {asked.truth}."
        assert sum(fact in doc for doc in asked.docs) == 1
    else:
        place = asked.question.split("key to the ")[1].removesuffix(" archive?")
        (keyed,) = [doc for doc in asked.docs if f"key to the {place} archive" in doc]
        holder = keyed.split(f"key to the {place} archive is held by ")[1].split(".")[0]
        (badge,) = [doc for doc in asked.docs if f"badge number of {holder} is" in doc]
        assert f"badge number of {holder} is {asked.truth}." in badge
        assert badge is not keyed  # the second hop is in another document


def test_documents_are_about_the_words_asked():
    asked = pic_accuracy.question(4, 200, 1, random.Random(0))
    for doc in asked.docs:
        assert 200 <= len(doc.split()) <= 260


def test_the_answer_is_the_first_sentence():
    first = pic_accuracy.first_sentence
    assert first(" 2618. The key to") == "2618"
    assert first(" 3.5 units. more") == "3.5 units"
    assert first("no stop\nnext") == "no stop"


def test_a_rows_recomputed_share_is_of_the_document_tokens():
    from types import SimpleNamespace

    usage = SimpleNamespace(
        pic_hit_tokens=80, pic_miss_tokens=20, pic_recomputed_tokens=15, ttft_s=0.1
    )
    asked = pic_accuracy.question(4, 50, 1, random.Random(0))
    found = {
        "plain": SimpleNamespace(text=" 1234. more", usage=SimpleNamespace(ttft_s=1.0)),
        "tokens, 15% recomputed": SimpleNamespace(text=" 1234. other", usage=usage),
    }
    row = pic_accuracy.scored(found, asked)["tokens, 15% recomputed"]
    assert row["same"]
    assert (row["hit"], row["recomputed"]) == (0.8, 0.15)
    assert pic_accuracy.recompute_label("tokens", 0.15) == "tokens, 15% recomputed"
    label = pic_accuracy.recompute_label("tokens", 0.05, "sequential")
    assert label == "tokens, sequential, 5% recomputed"


def test_a_configurations_label_says_how_its_tokens_were_chosen():
    label = pic_accuracy.recompute_label
    assert label("tokens", 0.15) == "tokens, 15% recomputed"
    assert label("tokens", 0.15, "sequential", "deviation") == (
        "tokens, sequential, 15% recomputed by deviation"
    )
    assert label("tokens", 0, select="deviation") == "tokens, 0% recomputed"
