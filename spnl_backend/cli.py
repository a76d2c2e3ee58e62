"""The ``spnl-backend`` command: ``info`` (and ``generate`` / ``bench`` as they arrive)."""

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import structlog

from .errors import PlatformError, SettingsError
from .log import LOGGER_NAME
from .settings import BackendSettings, PlatformDecisions, detect_platform, env_name, load_settings

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    _configure_console_logging(verbose=args.verbose)
    try:
        return args.run(args)
    except (SettingsError, PlatformError) as exc:
        print(f"spnl-backend: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spnl-backend",
        description="Run LLMs locally; configured by the MISTRALRS_* environment variables.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show info log events")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = commands.add_parser("info", help="print the resolved settings and platform decisions")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(run=_run_info)
    return parser


def _run_info(args: argparse.Namespace) -> int:
    settings = load_settings()
    decisions = detect_platform(settings)
    if args.json:
        print(json.dumps(_info_json(settings, decisions), indent=2, default=str))
    else:
        print(_info_table(settings, decisions))
    return 0


def _info_json(settings: BackendSettings, decisions: PlatformDecisions) -> dict[str, Any]:
    sources = BackendSettings.sources()
    return {
        "settings": {
            env_name(name): {"value": value, "source": sources[name]}
            for name, value in settings.model_dump(mode="json").items()
        },
        "kv_budget": vars(settings.kv_budget),
        "platform": decisions.as_dict(),
    }


def _info_table(settings: BackendSettings, decisions: PlatformDecisions) -> str:
    sources = BackendSettings.sources()
    rows = [
        (env_name(name), _show(value), sources[name])
        for name, value in settings.model_dump(mode="json").items()
    ]
    budget = settings.kv_budget
    platform_rows = [(key, _show(value)) for key, value in decisions.as_dict().items()]
    lines = ["settings", *_format_rows([("variable", "value", "source"), *rows])]
    lines += [
        "",
        f"KV budget: {budget.kind} = {budget.value:g}" + ("" if budget.explicit else " (default)"),
        "",
        "platform",
    ]
    lines += _format_rows(platform_rows)
    return "\n".join(lines)


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
        super().__init__()
        self._render = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, "spnl_event", record.getMessage())
        fields = getattr(record, "spnl_fields", {})
        return self._render(
            None,
            record.levelname.lower(),
            {"event": event, "level": record.levelname.lower(), **fields},
        )


def _configure_console_logging(verbose: bool) -> None:
    """The CLI owns its process, so it may configure the library's logger for the console."""
    logger = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ConsoleFormatter())
    logger.handlers = [h for h in logger.handlers if not isinstance(h.formatter, _ConsoleFormatter)]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False


if __name__ == "__main__":
    sys.exit(main())
