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


def test_text_lines_escape_every_separator_and_control() -> None:
    """A logged value cannot end the line or drive the terminal: C0/C1 controls, DEL, U+2028/2029, bidi
    overrides are escaped; printable text (accents, CJK) is left as it is."""
    from gpuhealth.runtime.logs import escape_for_log

    hostile = "a\nb\rc\x85d\x9be\x7ff\u2028g\u2029h\u202ei\x00j"
    assert escape_for_log(hostile) == "a\\x0ab\\x0dc\\x85d\\x9be\\x7ff\\u2028g\\u2029h\\u202ei\\x00j"
    assert escape_for_log("nœud-é 节点 ok") == "nœud-é 节点 ok"
    stream = io.StringIO()
    handler = setup_logging(stream=stream)
    try:
        log = logging.getLogger("gpuhealth.coordinator")
        log.warning("job %s: stalled", "j\u2028FORGED", extra={"rank": "r\x85FORGED"})
        try:
            raise ValueError("boom\u2028FORGED")
        except ValueError:
            log.exception("failed for %s", "x")
        lines = stream.getvalue().splitlines()  # splits on U+2028 and NEL too
        assert not any(line.startswith("FORGED") for line in lines)
        assert "j\\u2028FORGED" in lines[0] and "rank=r\\x85FORGED" in lines[0]
        assert all(line[:1].isdigit() or line.startswith("    ") for line in lines), lines
        assert any("boom\\u2028FORGED" in line for line in lines)
    finally:
        logging.getLogger("gpuhealth").removeHandler(handler)
