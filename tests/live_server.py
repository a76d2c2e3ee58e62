"""An in-process server for the tests: the app on a free 127.0.0.1 port, run by uvicorn
in a thread, over a tiny model with a chat template."""

import threading
import time

import httpx
import openai
import uvicorn
from helpers import CPU

from spnl_backend import Backend, load_backend
from spnl_backend.server.app import ServerConfig, ServerState, create_app
from spnl_backend.server.run import _listen

MODEL = "tiny-llama"
PROMPTS = ["The capital of France is", "Once upon a time there was", "def add(a, b):"]
TEMPLATE = (
    "<bos>{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class LiveServer:
    """The app on a free 127.0.0.1 port, served by uvicorn in a thread."""

    def __init__(self, backend, models=None, **config) -> None:
        self.state = ServerState(backend=backend, models=models)
        self.app = app = create_app(ServerConfig(MODEL, **config), self.state)
        sock = _listen("127.0.0.1", 0)  # the server's own listening socket
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def post(self, path: str, body: object, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def served_backend(tiny, template: str = TEMPLATE) -> Backend:
    backend = load_backend(str(tiny.hf("llama").path), settings=CPU)
    backend.tokenizer.hf.chat_template = template
    return backend
