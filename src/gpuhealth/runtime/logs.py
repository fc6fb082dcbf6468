"""Structured logs for both daemons: one line per record, human text or JSON lines.

Extra context travels as ``extra={...}`` on the log call (``collector``, ``gpu``, ``duration_s``);
the JSON formatter emits every such key. When an agent runs on a recording or scenario every
record says so (``"simulated": true`` / a ``[SIMULATED]`` prefix), so nobody mistakes replayed
readings for a live node.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

LOGGER_NAME = "gpuhealth"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "", None, None)).keys() | {"message", "asctime"}
)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS and not k.startswith("_")}


class JsonLinesFormatter(logging.Formatter):
    def __init__(self, *, simulated: bool = False) -> None:
        super().__init__()
        self.simulated = simulated

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.simulated:
            out["simulated"] = True
        for key, value in _extras(record).items():
            out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    def __init__(self, *, simulated: bool = False) -> None:
        super().__init__()
        self.simulated = simulated

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        prefix = "[SIMULATED] " if self.simulated else ""
        extra = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{stamp}Z {record.levelname.lower():7s} {prefix}{record.getMessage()}"
        if extra:
            line += f" ({extra})"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(
    *, json_lines: bool = False, level: str = "info", simulated: bool = False, stream: TextIO | None = None
) -> logging.Handler:
    """Route the ``gpuhealth`` logger to ``stream`` (stderr) in the chosen format. Idempotent: a
    second call (config reload) replaces the handler this function installed before."""
    logger = logging.getLogger(LOGGER_NAME)
    for h in list(logger.handlers):
        if getattr(h, "_gpuhealth_own", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLinesFormatter(simulated=simulated) if json_lines else TextFormatter(simulated=simulated))
    handler._gpuhealth_own = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    numeric = logging.getLevelName(level.strip().upper())
    logger.setLevel(numeric if isinstance(numeric, int) else logging.INFO)
    logger.propagate = False
    return handler


__all__ = ["LOGGER_NAME", "JsonLinesFormatter", "TextFormatter", "setup_logging"]
