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
import unicodedata
from typing import Any, TextIO

LOGGER_NAME = "gpuhealth"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "", None, None)).keys() | {"message", "asctime"}
)


# Characters a log reader may take as the end of a line or a terminal may act on: C0 and C1 controls (NEL,
# CSI 0x9b), DEL, Unicode line and paragraph separators, and format characters (bidi overrides that reorder
# what a person reads). Logged values come from tenants (job ids, rank names, dump summaries), so the text
# formatter escapes every one of them: no value can start a forged line or rewrite what precedes it.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Zl", "Zp", "Cf"})


def _is_unsafe(ch: str) -> bool:
    return unicodedata.category(ch) in _UNSAFE_CATEGORIES


def escape_for_log(text: str) -> str:
    """``text`` on one line with every unsafe character written as a Python escape (``\\n``, ``\\x9b``,
    ``\\u2028``)."""
    if text.isprintable():
        return text  # the common case, fast: printable text has no C0/C1, Zl, Zp or Cf characters
    out = []
    for ch in text:
        if _is_unsafe(ch):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


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
        extra = " ".join(f"{escape_for_log(str(k))}={escape_for_log(str(v))}" for k, v in _extras(record).items())
        line = f"{stamp}Z {record.levelname.lower():7s} {prefix}{escape_for_log(record.getMessage())}"
        if extra:
            line += f" ({extra})"
        if record.exc_info:
            # A traceback keeps its lines (people read it), each escaped and indented: no line of it can
            # start where a record starts (a timestamp in the first column).
            line += "".join("\n    " + escape_for_log(tb) for tb in self.formatException(record.exc_info).splitlines())
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
