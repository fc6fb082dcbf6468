"""node-problem-detector: our custom-plugin monitor config is a valid NPD config (checked against
NPD's custom plugin schema as its loader applies it), and the rule's command — the real
``gpuhealth status --exit-codes npd`` — answers in NPD's protocol: 0 OK, 1 problem (condition
set), 2 unknown, quickly enough for the rule's timeout."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gpuhealth.backends.nvml_fake import bundled_recording_path

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "deploy" / "npd" / "gpuhealth-monitor.json"
GPUHEALTH = Path(sys.executable).parent / "gpuhealth"

_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"}
_CAMEL = {"type": "string", "pattern": r"^[A-Z][A-Za-z0-9]*$"}
# NPD's pkg/custompluginmonitor/types config, as its JSON decoder and Validate() accept it.
NPD_CUSTOM_PLUGIN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["plugin", "pluginConfig", "source", "rules"],
    "properties": {
        "plugin": {"const": "custom"},
        "pluginConfig": {
            "type": "object",
            "properties": {
                "invoke_interval": _DURATION,
                "timeout": _DURATION,
                "max_output_length": {"type": "integer", "minimum": 1},
                "concurrency": {"type": "integer", "minimum": 1},
                "enable_message_change_based_condition_update": {"type": "boolean"},
                "skip_initial_status": {"type": "boolean"},
            },
            "additionalProperties": False,
        },
        "source": {"type": "string", "minLength": 1},
        "metricsReporting": {"type": "boolean"},
        "conditions": {"type": "array", "items": {
            "type": "object", "required": ["type", "reason", "message"],
            "properties": {"type": _CAMEL, "reason": _CAMEL, "message": {"type": "string"}},
            "additionalProperties": False}},
        "rules": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["type", "reason", "path"],
            "properties": {"type": {"enum": ["temporary", "permanent"]}, "condition": _CAMEL, "reason": _CAMEL,
                           "path": {"type": "string", "pattern": "^/"},
                           "args": {"type": "array", "items": {"type": "string"}}, "timeout": _DURATION},
            "additionalProperties": False}},
    },
    "additionalProperties": False,
}


def seconds(duration: str) -> float:
    units = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)(ns|us|ms|s|m|h)", duration))


def config() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(CONFIG.read_text())
    return data


def test_config_is_a_valid_custom_plugin_monitor() -> None:
    cfg = config()
    jsonschema.validate(cfg, NPD_CUSTOM_PLUGIN_SCHEMA)
    declared = {c["type"] for c in cfg["conditions"]}
    for rule in cfg["rules"]:
        if rule["type"] == "permanent":
            assert rule["condition"] in declared  # NPD refuses a permanent rule without its condition
        assert seconds(rule.get("timeout", cfg["pluginConfig"]["timeout"])) <= seconds(
            cfg["pluginConfig"]["invoke_interval"])


def test_schema_rejects_what_npd_rejects() -> None:
    bad = config()
    bad["rules"][0]["type"] = "sometimes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, NPD_CUSTOM_PLUGIN_SCHEMA)
    bad = config()
    bad["pluginConfig"]["invoke_interval"] = "60"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, NPD_CUSTOM_PLUGIN_SCHEMA)


def _rule_argv(extra: list[str]) -> list[str]:
    (rule,) = config()["rules"]
    assert rule["path"] == "/usr/local/bin/gpuhealth"  # where the install docs put it
    return [str(GPUHEALTH), *rule["args"], *extra]


@pytest.mark.parametrize(("scenario", "expected"), [
    (None, 0),  # the real H200 recording: healthy → OK, condition False
    ({"events": [{"at": 0, "type": "xid", "gpu": 0, "xid": 79}]}, 1),  # XID 79 → problem, condition True
    ({"events": [{"at": 0, "type": "set", "gpu": 1, "key": "TotalEccErrors_UNCORRECTED_VOLATILE",
                  "value": 3}]}, 1),
])
def test_rule_command_speaks_npd_exit_codes(tmp_path: Path, scenario: dict[str, Any] | None, expected: int) -> None:
    snapshot = bundled_recording_path("nvml_h200x2.json")
    if scenario is not None:
        snapshot = tmp_path / "scenario.yaml"
        snapshot.write_text(yaml.safe_dump({"recording": "nvml_h200x2.json", **scenario}))
    start = time.monotonic()
    result = subprocess.run(_rule_argv(["--nvml-snapshot", str(snapshot)]), capture_output=True, text=True,
                            timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == expected, result.stdout + result.stderr
    assert result.stdout.strip(), "NPD shows stdout as the condition message"
    assert elapsed < seconds(config()["rules"][0]["timeout"])


def test_rule_command_that_cannot_check_is_unknown(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = subprocess.run(_rule_argv(["--nvml-snapshot", str(broken)]), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
