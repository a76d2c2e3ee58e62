"""The request fuzzing of tests/test_request_fuzz.py with many more examples than CI runs.

    python bench/fuzz_requests.py [--examples N]

Every generated request must work or raise `RequestError` while a healthy stream beside it
finishes unchanged. Prints pytest's summary and hypothesis's statistics per property.
"""

import argparse
import os
import sys
from pathlib import Path

import pytest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000, help="per property (CI: 50)")
    args = parser.parse_args()
    os.environ["SPNL_FUZZ_EXAMPLES"] = str(args.examples)
    tests = Path(__file__).resolve().parent.parent / "tests" / "test_request_fuzz.py"
    return pytest.main([str(tests), "-q", "-p", "no:cacheprovider", "--hypothesis-show-statistics"])


if __name__ == "__main__":
    sys.exit(main())
