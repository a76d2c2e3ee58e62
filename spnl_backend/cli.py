"""The ``spnl-backend`` command: ``generate``, ``serve`` and ``info``.

Everything but a few standard modules (torch, structlog, the model) loads inside `main`'s
error handling, so Ctrl-C from then on ends the command with one line and exit status
130, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .errors import SettingsError, SpnlError
from .version import version_info, version_line

if TYPE_CHECKING:
    from .settings import BackendSettings, PlatformDecisions

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # what shells report for a command ended by Ctrl-C (128 + SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _build_parser().parse_args(argv)
        _configure_console_logging(args.verbose, args.quiet)
        with _interrupts_deferred():  # torch's import aborts the process if interrupted
            import torch  # noqa: F401
        return args.run(args)
    except SpnlError as exc:
        print(f"spnl-backend: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("spnl-backend: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except OSError as exc:  # the output cannot be written: a full disk, say
        print(f"spnl-backend: error: cannot write the output: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def entry() -> None:
    """The console script: `main`, then an exit that no second Ctrl-C and no unwritable
    output can turn into a traceback (the interpreter's own teardown is skipped: the
    command owns its process and has nothing left to release)."""
    try:
        code = main()
    except KeyboardInterrupt:  # a second Ctrl-C while the first was being reported
        code = EXIT_INTERRUPTED
    while True:  # from here on Ctrl-C changes nothing: ignore it, even mid-call
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            break
        except KeyboardInterrupt:
            code = EXIT_INTERRUPTED
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, full, or gone
            code = code or EXIT_FAILURE
    os._exit(code)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold a Ctrl-C until the block is done, then raise it: some native code (torch's
    import) cannot be interrupted halfway without terminating the process."""
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spnl-backend",
        description="Run LLMs locally; configured by the MISTRALRS_* environment variables.",
    )
    parser.add_argument(
        "--version", action="version", version=version_line(), help="print the version and exit"
    )
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug log events too (sets MISTRALRS_VERBOSE=1), and serve's access log",
    )
    loudness.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = commands.add_parser("info", help="print the resolved settings and platform decisions")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.add_argument(
        "--model",
        help="also say whose code would run this model, and why (MISTRALRS_MODEL_IMPL; "
        "default: MISTRALRS_MODEL); nothing is downloaded or loaded",
    )
    info.set_defaults(run=_run_info)
    generate = commands.add_parser(
        "generate", help="complete prompts: streams one, shows progress for several"
    )
    generate.add_argument("prompts", nargs="+", metavar="PROMPT")
    generate.add_argument(
        "--model", help="model name or path (default: MISTRALRS_MODEL, else the embedded default)"
    )
    generate.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="tokens to generate (default 128; 0: until EOS or the end of the context)",
    )
    generate.add_argument("--temperature", type=float, default=0.6, help="0 is greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", help="a stop string (repeatable)")
    generate.add_argument("--json", action="store_true", help="print results with usage as JSON")
    generate.set_defaults(run=_run_generate)
    _add_serve(commands)
    _add_chat(commands)
    return parser


def _add_chat(commands: Any) -> None:
    chat = commands.add_parser(
        "chat", help="talk with the model in the terminal (streamed, the conversation kept)"
    )
    chat.add_argument(
        "--model", help="model name or path (default: MISTRALRS_MODEL, else the embedded default)"
    )
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument(
        "--max-tokens", type=int, default=0, help="tokens per answer at most (0: until EOS)"
    )
    chat.add_argument("--temperature", type=float, default=0.6, help="0 is greedy")
    chat.add_argument("--seed", type=int)
    chat.set_defaults(run=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    from .load import load_backend
    from .loader.progress import TqdmProgress
    from .request import sampling_params
    from .terminal_chat import run_chat

    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    sampling_params(**sampling)  # a bad parameter fails before the model loads
    backend = load_backend(args.model, progress=TqdmProgress())
    return run_chat(backend, sampling, args.system)


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (SSE streaming)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    serve.add_argument(
        "--model",
        action="append",
        help="model name or path (default: MISTRALRS_MODEL, else the embedded default); "
        "repeat it (PATH or NAME=PATH) to serve several, each loaded on its first request",
    )
    serve.add_argument(
        "--keep-alive",
        default="5m",
        help="with several models: how long one stays loaded once idle, as Ollama takes it "
        "(seconds, or a duration such as 5m or 1h; negative: for ever; default 5m)",
    )
    serve.add_argument(
        "--memory-budget-mb",
        type=int,
        help="with several models: the memory they may hold together (default: no bound)",
    )
    serve.add_argument(
        "--served-model-name",
        help="the name clients use (default: the model file's or directory's name)",
    )
    serve.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' (default: SPNL_BACKEND_API_KEY; unset: none)",
    )
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="sequences that may wait beyond those running before requests get 503 (256)",
    )
    serve.add_argument(
        "--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body"
    )
    serve.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds running requests get to finish on SIGINT/SIGTERM (default 30)",
    )
    serve.add_argument(
        "--open-metrics",
        action="store_true",
        help="serve /metrics without the API key (for a scraper); by default it needs the key",
    )
    serve.add_argument(
        "--allowed-hosts",
        type=lambda text: text.split(","),
        help="Host names requests may carry, comma-separated ('*': any); default: on a "
        "loopback address its own names (localhost, 127.0.0.1, ::1), elsewhere any",
    )
    serve.add_argument(
        "--allowed-origins",
        type=lambda text: text.split(","),
        help="web pages whose scripts may call the API and read its answers (CORS), as "
        "origins, comma-separated (https://app.example; '*': any); default: none",
    )
    serve.add_argument(
        "--chat-template",
        action="append",
        help="the chat template to use instead of the model's: a Jinja file or the Jinja "
        "source itself (default: MISTRALRS_CHAT_TEMPLATE, else the model's own); with "
        "several models, NAME=FILE gives model NAME its own (repeat it, one per model)",
    )
    serve.add_argument(
        "--default-chat-template-kwargs",
        metavar="JSON",
        help="chat template variables every chat gets, as a JSON object (such as "
        "'{\"enable_thinking\": false}'); a request's chat_template_kwargs win over them "
        "(default: MISTRALRS_DEFAULT_CHAT_TEMPLATE_KWARGS, else none)",
    )
    serve.add_argument(
        "--reasoning-format",
        help="how reasoning is told from the answer: auto (read from the chat template), "
        "none, think (<think> blocks), granite, harmony (gpt-oss) (default: "
        "MISTRALRS_REASONING_FORMAT, else auto)",
    )
    serve.add_argument(
        "--lora",
        action="append",
        metavar="NAME=PATH",
        help="a LoRA adapter (PEFT directory or GGUF file), chosen by requests whose model "
        "is NAME; with several models, MODEL:NAME=PATH puts it on the served model MODEL "
        "(repeatable; default: MISTRALRS_LORA_ADAPTERS)",
    )
    serve.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish KV cache events in vLLM's format (msgpack over ZMQ PUB) for KV-aware "
        "routers, e.g. tcp://*:5557 (bound; a host name is connected to); needs pyzmq and "
        "msgpack (pip install 'spnl-backend[kv-events]'); default: off",
    )
    serve.add_argument(
        "--kv-events-replay",
        metavar="ENDPOINT",
        help="a ZMQ ROUTER endpoint that replays recent event batches to a router that "
        "joined late, e.g. tcp://*:5558 (with --kv-events)",
    )
    serve.add_argument(
        "--kv-events-topic", default="", help="the topic of every event message (default '')"
    )
    serve.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from .server.run import serve

    return serve(
        host=args.host,
        port=args.port,
        model=args.model,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        grace_s=args.grace,
        verbose=args.verbose,
        open_metrics=args.open_metrics,
        allowed_hosts=args.allowed_hosts,
        allowed_origins=args.allowed_origins,
        keep_alive_s=_keep_alive(args.keep_alive),
        memory_budget_mb=args.memory_budget_mb,
        chat_template=args.chat_template,
        reasoning_format=args.reasoning_format,
        lora=args.lora,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        kv_events_topic=args.kv_events_topic,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
    )


def _keep_alive(value: str) -> float:
    from .server.ollama import keep_alive_s
    from .server.protocol import ApiError

    try:
        seconds = keep_alive_s(value)
    except ApiError as exc:
        raise SettingsError(f"--keep-alive: {exc.message}") from None
    return 300.0 if seconds is None else seconds


def _run_generate(args: argparse.Namespace) -> int:
    from .load import load_backend
    from .loader.progress import TqdmProgress
    from .request import sampling_params

    request = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
    }
    params = sampling_params(**request)  # a bad parameter fails before the model loads
    backend = load_backend(args.model, progress=TqdmProgress())
    if args.json:
        results = backend.generate(args.prompts, **request)
        print(json.dumps([_result_json(r) for r in results], indent=2))
    elif len(args.prompts) == 1:
        try:
            for piece in backend.stream(args.prompts[0], **request):
                print(piece, end="", flush=True)
        finally:
            print()  # the streamed line ends, even when Ctrl-C cut it short
    else:
        _generate_with_progress(backend, args.prompts, params)
    return 0


def _generate_with_progress(backend: Any, prompts: list[str], params: Any) -> None:
    from tqdm import tqdm

    texts: dict[int, str] = {}
    with tqdm(
        total=len(prompts), desc="prompts", unit="prompt", file=sys.stderr, disable=None
    ) as bar:
        for output in backend.run_steps(prompts, params):
            if output.seq.is_finished:
                texts[output.seq.seq_id] = output.seq.text
                bar.update(1)
    # Sequence ids follow the order the prompts were added in.
    for number, (prompt, seq_id) in enumerate(zip(prompts, sorted(texts), strict=True), 1):
        print(f"--- {number}: {prompt!r}")
        print(texts[seq_id])


def _result_json(result: Any) -> dict[str, Any]:
    return {
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "usage": vars(result.usage),
    }


def _run_info(args: argparse.Namespace) -> int:
    from .settings import detect_platform, load_settings

    settings = load_settings()
    decisions = detect_platform(settings)
    model = _model_implementation(settings, args.model)
    if args.json:
        print(
            json.dumps({**_info_json(settings, decisions), "model": model}, indent=2, default=str)
        )
    else:
        rows = [(key, _show(value)) for key, value in model.items()]
        print(_info_table(settings, decisions) + "\n\nmodel\n" + "\n".join(_format_rows(rows)))
    return 0


_IMPL_RULES = {
    "auto": "a family module where the model type has one, else transformers' modeling code",
    "native": "a family module; a model type without one is refused",
    "transformers": "transformers' modeling code for every safetensors model",
}


def _model_implementation(settings: BackendSettings, name: str | None) -> dict[str, Any]:
    """Whose code would run the model named (or MISTRALRS_MODEL), and why; without one, the
    rule MISTRALRS_MODEL_IMPL sets. Only files already here are read."""
    from .errors import SpnlError
    from .loader.resolve import resolve_model
    from .loader.transformers_path import choose_implementation

    name = name or settings.model
    rule = f"{settings.model_impl}: {_IMPL_RULES[settings.model_impl]}"
    if name is None:
        return {"name": None, "implementation": rule}
    try:
        implementation, why = choose_implementation(
            resolve_model(name, allow_download=False), settings.model_impl
        )
    except SpnlError as exc:
        return {"name": name, "rule": rule, "error": str(exc)}
    return {"name": name, "implementation": implementation, "why": why, "rule": rule}


def _topology(settings: BackendSettings, decisions: PlatformDecisions) -> dict[str, Any]:
    """The processes a backend loaded with these settings would span and its layers'
    devices, and why (or the error that loading would raise)."""
    from dataclasses import asdict

    from .errors import SettingsError
    from .settings.topology import decide_layer_map, decide_topology, launch_environment

    devices = decisions.device_type, decisions.cuda_device_count
    try:
        topology = decide_topology(settings, *devices, launch_environment())
        layer_map = decide_layer_map(settings, topology, *devices)
    except SettingsError as exc:
        return {"error": str(exc)}
    mapped = None
    if layer_map is not None:  # counts of 0: shared out evenly once the model is known
        spans = "; ".join(f"{d}: {n or 'even share'}" for d, n in layer_map.spans)
        mapped = f"{spans} ({layer_map.why})"
    return {**asdict(topology), "layer_map": mapped}


def _info_json(settings: BackendSettings, decisions: PlatformDecisions) -> dict[str, Any]:
    from .settings import env_name

    sources = settings.sources()
    return {
        **version_info(),
        "settings": {
            env_name(name): {"value": value, "source": sources[name]}
            for name, value in settings.model_dump(mode="json").items()
        },
        "kv_budget": vars(settings.kv_budget),
        "platform": decisions.as_dict(),
        "topology": _topology(settings, decisions),
        "speculation": _speculation(settings, decisions),
    }


def _info_table(settings: BackendSettings, decisions: PlatformDecisions) -> str:
    from .settings import env_name

    sources = settings.sources()
    rows = [
        (env_name(name), _show(value), sources[name])
        for name, value in settings.model_dump(mode="json").items()
    ]
    budget = settings.kv_budget
    platform_rows = [(key, _show(value)) for key, value in decisions.as_dict().items()]
    lines = [
        version_line(),
        "",
        "settings",
        *_format_rows([("variable", "value", "source"), *rows]),
    ]
    lines += [
        "",
        f"KV budget: {budget.kind} = {budget.value:g}" + ("" if budget.explicit else " (default)"),
        "",
        "platform",
    ]
    lines += _format_rows(platform_rows)
    topology_rows = [(key, _show(value)) for key, value in _topology(settings, decisions).items()]
    lines += ["", "topology", *_format_rows(topology_rows)]
    speculation = _speculation(settings, decisions)
    lines += ["", "speculation", *_format_rows([(k, _show(v)) for k, v in speculation.items()])]
    return "\n".join(lines)


def _speculation(settings: BackendSettings, decisions: PlatformDecisions) -> dict[str, Any]:
    """What would propose the tokens the target verifies, and why, as far as it is known
    before a model loads (its cache's ability to drop tokens is known at load, where the
    `speculative.method` event says what was chosen)."""
    from .settings.speculation import choose_speculation

    world_size = _topology(settings, decisions).get("world_size", 1)
    choice = choose_speculation(
        settings, tensor_parallel=world_size > 1, state_layers=None, cache_rolls_back=None
    )
    return {"method": choice.method or "none", "why": choice.why}


def _show(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, list | tuple):
        return "; ".join(map(str, value)) or "-"
    return str(value)


def _format_rows(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


class _ConsoleFormatter(logging.Formatter):
    """Renders the library's structured events with structlog's console renderer."""

    def __init__(self) -> None:
        import structlog

        super().__init__()
        self._render = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, "spnl_event", record.getMessage())
        fields = getattr(record, "spnl_fields", {})
        line = self._render(
            None,
            record.levelname.lower(),
            {"event": event, "level": record.levelname.lower(), **fields},
        )
        if record.exc_info:  # a plain traceback: no local variables, which hold prompts
            line += "\n" + self.formatException(record.exc_info)
        return line


def _configure_console_logging(verbose: bool, quiet: bool) -> None:
    """The CLI owns its process, so it may configure the library's logger for the console:
    info events by default, as uvicorn shows them (what loads, where it listens)."""
    from .log import LOGGER_NAME, pin_verbose

    if verbose:  # kept on when a load reads MISTRALRS_VERBOSE
        pin_verbose()
    logger = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ConsoleFormatter())
    logger.handlers = [h for h in logger.handlers if not isinstance(h.formatter, _ConsoleFormatter)]
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    logger.propagate = False


if __name__ == "__main__":
    entry()
