"""Structured logs: JSON lines carry extras and the SIMULATED flag; text lines say SIMULATED."""

from __future__ import annotations

import io
import json
import logging

from gpuhealth.runtime.logs import setup_logging


def test_json_lines_with_extras_and_simulated_flag() -> None:
    stream = io.StringIO()
    handler = setup_logging(json_lines=True, level="info", simulated=True, stream=stream)
    try:
        log = logging.getLogger("gpuhealth.agent")
        log.info("collector %s failed", "ecc", extra={"collector": "ecc", "duration_s": 0.5})
        log.debug("hidden at info level")
        lines = stream.getvalue().splitlines()
        assert len(lines) == 1
        rec = json.loads(lines[0])
        assert rec["msg"] == "collector ecc failed"
        assert rec["level"] == "info" and rec["logger"] == "gpuhealth.agent"
        assert rec["collector"] == "ecc" and rec["duration_s"] == 0.5
        assert rec["simulated"] is True
    finally:
        logging.getLogger("gpuhealth").removeHandler(handler)


def test_text_lines_are_marked_simulated_and_setup_is_idempotent() -> None:
    first, second = io.StringIO(), io.StringIO()
    setup_logging(simulated=True, stream=first)
    handler = setup_logging(simulated=True, stream=second)  # a reload replaces, never duplicates
    try:
        logging.getLogger("gpuhealth.agent").warning("NVML went away", extra={"gpu": 3})
        assert first.getvalue() == ""
        line = second.getvalue().strip()
        assert "[SIMULATED] NVML went away" in line and "gpu=3" in line
    finally:
        logging.getLogger("gpuhealth").removeHandler(handler)
