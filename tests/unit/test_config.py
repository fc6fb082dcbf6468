"""Config validation: every key is checked for type, range and finiteness, and a bad file, variable or
flag is one line naming the key and where it came from — never a traceback, never a running agent
on a NaN interval.

The attacks run for real: files on disk (non-UTF-8, a YAML alias bomb, a huge file), the real
``gpuhealth agent`` / ``gpuhealth status`` processes under a memory and a time cap.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from capped import run_capped

from gpuhealth.config import Config, ConfigError, load_config


def _numeric_keys() -> list[tuple[str, str, bool]]:
    """(section, key, integer) for every numeric key of every section."""
    out = []
    cfg = Config()
    for f in dataclasses.fields(cfg):
        for key, hint in get_type_hints(type(getattr(cfg, f.name))).items():
            text = str(hint)
            if hint is bool or text == "bool":
                continue
            if hint in (int, float) or text.startswith(("int", "float")):
                out.append((f.name, key, hint is int or text.startswith("int")))
    return out


NUMERIC = _numeric_keys()


def _write(tmp_path: Path, text: str | bytes, name: str = "gpuhealth.yaml") -> Path:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return p


def _error(path: Path | None = None, **kw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, **kw)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_there_are_numeric_keys_to_check() -> None:
    assert len(NUMERIC) > 20  # the scan below is not vacuous


@pytest.mark.parametrize("bad", [".nan", ".inf", "-.inf", "-1e308", "1e308", "abc", "[1]", "{a: 1}", "true"])
def test_every_numeric_key_refuses_values_that_cannot_be_meant(tmp_path: Path, bad: str) -> None:
    # One loop over every numeric key of every section: a key added without a range fails here.
    for section, key, _integer in NUMERIC:
        path = _write(tmp_path, f"{section}:\n  {key}: {bad}\n")
        message = _error(path, env={})
        assert message.startswith(f"{path}: {section}.{key}: "), message


def test_every_numeric_default_is_accepted_back_from_a_file(tmp_path: Path) -> None:
    cfg = Config()
    lines = []
    for section, key, _integer in NUMERIC:
        value = getattr(getattr(cfg, section), key)
        if value is not None:
            lines.append(f"{section}:\n  {key}: {value!r}\n")
    for n, text in enumerate(lines):
        load_config(_write(tmp_path, text, f"c{n}.yaml"), env={})


def test_the_reported_cases(tmp_path: Path) -> None:
    assert _error(_write(tmp_path, "collectors:\n  history_len: -3\n"), env={}).endswith(
        "collectors.history_len: must be >= 1 and <= 1000000, got -3")
    assert "collectors.fast_interval_s: must be a finite number" in _error(
        _write(tmp_path, "collectors:\n  fast_interval_s: .nan\n"), env={})
    assert "not UTF-8 text (byte 0xff at offset 21)" in _error(
        _write(tmp_path, b'agent:\n  node_name: "\xff\xfe"\n'), env={})


def test_integers_and_intervals(tmp_path: Path) -> None:
    assert "expected an integer, got 2.5" in _error(_write(tmp_path, "collectors:\n  history_len: 2.5\n"), env={})
    assert "must be > 0" in _error(_write(tmp_path, "collectors:\n  fast_interval_s: 0\n"), env={})
    assert "must be > 0" in _error(_write(tmp_path, "coordinator:\n  spool_commit_s: 0\n"), env={})
    cfg = load_config(_write(tmp_path, "collectors:\n  history_len: 8.0\n  fast_interval_s: '2.5'\n"), env={})
    assert cfg.collectors.history_len == 8 and cfg.collectors.fast_interval_s == 2.5


def test_text_keys_refuse_containers_booleans_and_control_characters(tmp_path: Path) -> None:
    assert "expected text, got a list" in _error(_write(tmp_path, "agent:\n  node_name: [a, b]\n"), env={})
    assert "expected text, got true" in _error(_write(tmp_path, "agent:\n  node_name: yes\n"), env={})
    assert "control character" in _error(_write(tmp_path, 'agent:\n  state_dir: "/var/\\0lib"\n'), env={})
    assert "over 4096" in _error(_write(tmp_path, f"agent:\n  node_name: {'x' * 5000}\n"), env={})
    assert "collectors.disabled[1]: expected text" in _error(
        _write(tmp_path, "collectors:\n  disabled: [ecc, {a: 1}]\n"), env={})


def test_the_environment_names_its_variable() -> None:
    message = _error(env={"GPUHEALTH_COLLECTORS_FAST_INTERVAL_S": "nan"})
    assert message.startswith("environment GPUHEALTH_COLLECTORS_FAST_INTERVAL_S (collectors.fast_interval_s): ")
    assert _error(env={}, overrides={"coordinator": {"max_inflight": 0}}).startswith("flags: coordinator.max_inflight")


def test_files_that_are_not_a_config(tmp_path: Path) -> None:
    assert "not valid YAML (line 3, column 1)" in _error(_write(tmp_path, "collectors:\n fast: [1\n"), env={})
    assert "over 1048576 bytes" in _error(_write(tmp_path, "# x\n" * 300_000), env={})
    assert "cannot read" in _error(tmp_path / "missing.yaml", env={})
    assert "unknown key 'agent.nope'" in _error(_write(tmp_path, "agent:\n  nope: 1\n"), env={})
    assert "unknown section '1'" in _error(_write(tmp_path, "1: {a: 1}\n"), env={})


def _bomb(depth: int) -> str:
    """A few hundred bytes of YAML whose one text key stands for 9**depth strings (anchors nest inside
    the value itself, so every key is a known one)."""
    value = "&l0 ['xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx']"
    for i in range(1, depth + 1):
        value = f"&l{i} [{value}, " + ", ".join([f"*l{i - 1}"] * 8) + "]"
    return f"agent:\n  node_name: {value}\n"


CAP_BYTES = 1 << 30  # 1 GiB of address space: str() of the bomb needs tens of GB


@pytest.mark.parametrize("command", ["agent", "status"])
def test_bad_configs_are_one_line_from_the_real_commands_under_caps(tmp_path: Path, command: str) -> None:
    cases: dict[str, tuple[str | bytes, str]] = {
        "history.yaml": ("collectors:\n  history_len: -3\n", "collectors.history_len: must be >= 1"),
        "nan.yaml": ("collectors:\n  fast_interval_s: .nan\n", "collectors.fast_interval_s: must be a finite"),
        "latin1.yaml": (b'agent:\n  node_name: "caf\xe9"\n', "not UTF-8 text (byte 0xe9"),
        "bomb.yaml": (_bomb(9), "agent.node_name: expected text, got a list"),
    }
    for name, (text, expected) in cases.items():
        path = _write(tmp_path, text, name)
        proc = run_capped([sys.executable, "-m", "gpuhealth.cli.main", command, "--config", str(path)],
                          mem_bytes=CAP_BYTES, cpu_s=30, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3, (name, proc.returncode, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and expected in lines[0] and str(path) in lines[0], proc.stderr


def test_the_alias_bomb_is_small_and_would_be_huge() -> None:
    import yaml

    text = _bomb(9)
    assert len(text) < 1000
    value = yaml.safe_load(text)["agent"]["node_name"]
    for _ in range(8):  # 9 elements at every level down to the strings
        assert len(value) == 9
        value = value[0]


def test_dcgm_schema_takes_a_release_from_file_or_variable_and_says_to_quote_4_10(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    assert load_config(None).agent.dcgm_schema == "4.10"
    path.write_text('agent:\n  dcgm_schema: "4.8"\n')
    assert load_config(str(path)).agent.dcgm_schema == "4.8"
    assert load_config(None, env={"GPUHEALTH_AGENT_DCGM_SCHEMA": "both"}).agent.dcgm_schema == "both"
    path.write_text("agent:\n  dcgm_schema: 4.10\n")  # YAML: the number 4.1
    with pytest.raises(ConfigError, match=r"'4\.1' is not one of 4\.10, 4\.8, both \(quote it"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="GPUHEALTH_AGENT_DCGM_SCHEMA"):
        load_config(None, env={"GPUHEALTH_AGENT_DCGM_SCHEMA": "4.9"})
