"""bench/pic.py's pure parts: spnl's token F1 and the synthetic documents."""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pic


def test_token_f1_is_spnls():
    assert pic.f1("", "") == 100.0
    assert pic.f1("a", "") == 0.0
    assert pic.f1("The code is 4721.", "the CODE is 4721") == 100.0
    # 2 of 3 candidate words in a 4-word reference: P = 2/3, R = 1/2
    precision, recall = 2 / 3, 1 / 2
    expected = 200 * precision * recall / (precision + recall)
    assert abs(pic.f1("code is nine", "the code is 4721") - expected) < 1e-9
    assert pic.f1("a a b", "a b b") == pic.f1("a b b", "a a b")


def test_documents_carry_the_code_in_one_and_are_seeded():
    one = pic.documents(20, 4, random.Random(3), code=1234)
    assert one == pic.documents(20, 4, random.Random(3), code=1234)
    assert [("1234" in doc) for doc in one] == [False, True, False, False]
    assert all(doc.startswith(f"Document {i}: ") for i, doc in enumerate(one))
    assert len(one[0].split()) == 20 + 9
