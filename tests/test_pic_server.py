"""PIC through the server: spnl's marked chat messages and sentinel token ids, their usage
and metrics, and ``n`` completions sharing a PIC prompt."""

import httpx
import pytest
from live_server import MODEL, TEMPLATE

from spnl_backend import BackendSettings, load_backend
from spnl_backend.pic.pieces import PLUS_MARKER

PLUS, CROSS = 5, 6
DOCS = ["Once upon a time there was a little model.", "The capital of France is Paris."]


@pytest.fixture(scope="module")
def backend(tiny):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPNL_PIC_PLUS_TOKEN", str(PLUS))
        patch.setenv("SPNL_PIC_CROSS_TOKEN", str(CROSS))
        settings = BackendSettings(device="cpu", paged_attn_block_size=16)
        backend = load_backend(str(tiny.hf("llama").path), settings=settings)
    backend.tokenizer.hf.chat_template = TEMPLATE
    yield backend
    backend.close()


def _messages(order):
    return [
        {"role": "system", "content": "Answer from the documents."},
        *[{"role": "user", "content": PLUS_MARKER + DOCS[i]} for i in order],
        {"role": "user", "content": "What do they say?"},
    ]


def _chat(live, messages, **extra):
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    response = live.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def test_marked_chat_messages_are_reused_across_requests(live, backend):
    first = _chat(live, _messages([0, 1]))
    second = _chat(live, _messages([1, 0]))
    expected = backend.chat(_messages([1, 0]), max_tokens=8, temperature=0)
    details = [reply["usage"]["prompt_tokens_details"] for reply in (first, second)]
    assert details[0]["pic_hit_tokens"] + details[0]["pic_miss_tokens"] > 0
    assert details[1]["pic_miss_tokens"] == 0
    assert (
        details[1]["pic_hit_tokens"] == details[0]["pic_hit_tokens"] + details[0]["pic_miss_tokens"]
    )
    assert second["choices"][0]["message"]["content"] == expected.text
    text = httpx.get(live.url + "/metrics").text
    assert "spnl_pic_hit_tokens" in text
    assert "spnl_pic_miss_tokens" in text


def test_sentinel_token_ids_in_a_completion(live, backend):
    words = backend.tokenizer.encode_plain(" ".join(DOCS))
    ids = [*words[:4], PLUS, *words[4:12], PLUS, *words[12:20], CROSS, *words[20:]]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0}
    reply = live.post("/v1/completions", body).json()
    expected = backend.generate(prompt_token_ids=ids, max_tokens=8, temperature=0)
    assert reply["choices"][0]["text"] == expected.text
    assert reply["usage"]["prompt_tokens"] == len(ids) - 3  # the sentinels are not the prompt
    bad = live.post("/v1/completions", {**body, "prompt": [*words[:3], PLUS]})
    assert bad.status_code == 400
    assert "empty span" in bad.json()["error"]["message"]


def test_n_completions_of_a_pic_prompt_share_its_elements(live, backend):
    """The first completion computes the elements; the other two wait for it and map them
    in from the pool."""
    messages = _messages([])
    messages.insert(1, {"role": "user", "content": PLUS_MARKER + "A document seen once."})
    before = backend.stats()
    reply = _chat(live, messages, n=3, temperature=0.8, seed=7)
    after = backend.stats()
    missed = reply["usage"]["prompt_tokens_details"]["pic_miss_tokens"]
    assert len(reply["choices"]) == 3
    assert missed > 0
    assert after.pic_miss_tokens - before.pic_miss_tokens == missed
    assert after.pic_hit_tokens - before.pic_hit_tokens == 2 * missed
