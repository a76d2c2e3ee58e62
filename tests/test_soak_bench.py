"""bench/soak.py's pure parts: the mix's requests and the report's verdicts."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench import soak


def test_every_kind_of_the_mix_is_a_request_of_its_own():
    paths = {}
    for i, kind in enumerate(soak.KINDS):
        path, payload = soak.body(kind, i, "m")
        paths[kind] = path
        if kind == "not_json":
            continue
        decoded = json.loads(payload) if isinstance(payload, bytes) else payload
        assert isinstance(decoded, dict)
    assert paths["span_query"].startswith("/v1/query/execute")
    first = soak.body("json_schema", 4, "m")[1]["response_format"]
    second = soak.body("json_schema", 14, "m")[1]["response_format"]
    assert first != second  # a new schema each time: past the compiled-grammar cache
    assert len(soak.body("stops_and_bias", 6, "m")[1]["logit_bias"]) == 256


def test_the_report_measures_growth_from_the_first_tenth():
    class Args:
        requests, clients, every = 1000, 8, 100

    samples = [
        {"requests": n, "s": n / 10, "rss_mb": 1000 + n / 10, "fds": 7, "threads": 12, "pool": 0}
        for n in range(100, 1100, 100)
    ]
    result = {"samples": samples, "statuses": [("completion", 200)] * 9 + [("not_json", 400)]}
    text = soak.report({**result, "same": True, "pool": 0}, Args())
    assert "RSS after 100 requests 1,010 MB, at the end 1,100 MB (+8.9%" in text
    assert "{'200': 9, '400': 1}" in text
    assert "same text before and after: True" in text
