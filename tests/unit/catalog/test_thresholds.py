"""The thresholds catalog: bundled file parses, every number carries a source, bad files are clear errors."""

from __future__ import annotations

import dataclasses
import re
from importlib import resources
from types import SimpleNamespace

import pytest
import yaml

from gpuhealth.catalog.thresholds import (
    Thresholds,
    ThresholdsError,
    default_thresholds,
    load_thresholds,
    parse_thresholds,
    thresholds_from,
)
from gpuhealth.config import Config


def test_bundled_file_matches_the_typed_defaults():
    # The YAML and the dataclass defaults must tell the same story (no silent drift).
    assert default_thresholds() == Thresholds()
    assert default_thresholds() is default_thresholds()  # parsed once


def test_every_value_in_the_bundled_file_is_preceded_by_a_comment_naming_a_source():
    text = (resources.files("gpuhealth") / "catalog" / "thresholds.yaml").read_text()
    lines = text.splitlines()
    sources = ("DCGM", "NVML", "NV-memerr", "GPUd", "PCIe-spec", "kernel", "ibdiagnet", "UFM", "Kernel")
    for n, line in enumerate(lines):
        if re.match(r"^  \w+: ", line):  # a value inside a section
            block = []
            j = n - 1
            while j >= 0 and re.match(r"^  (\w+: |#)", lines[j]):  # comments may cover a group of keys
                if lines[j].startswith("  #"):
                    block.append(lines[j])
                j -= 1
            assert any(s in c for c in block for s in sources), f"no source for: {line.strip()}"


def test_parse_overrides_one_key_and_keeps_the_rest():
    t = parse_thresholds({"pcie": {"replay_bit_error_rate": 1e-11}, "ecc": {"dbe_volatile_critical": 3}})
    assert t.pcie.replay_bit_error_rate == 1e-11 and t.ecc.dbe_volatile_critical == 3
    assert t.nvlink == Thresholds().nvlink


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"pcie": {"nope": 1}}, "pcie.nope: unknown key"),
        ({"nvlinks": {}}, "unknown section 'nvlinks'"),
        ({"ecc": {"dbe_volatile_critical": "one"}}, "ecc.dbe_volatile_critical: expected a number"),
        ({"ecc": {"dbe_volatile_critical": 1.5}}, "expected an integer"),
        ({"ecc": [1, 2]}, "ecc: must be a mapping"),
        ([1], "top level must be a mapping"),
        ({"pcie": {"width_degraded_severity": 3}}, "expected text"),
        ({"pcie": {"width_degraded_severity": "fatal"}}, "pcie.width_degraded_severity: expected info, warning"),
    ],
)
def test_bad_data_names_the_key(data, message):
    with pytest.raises(ThresholdsError, match=re.escape(message)):
        parse_thresholds(data, "my.yaml")


def test_files_and_context_lookup(tmp_path):
    good = tmp_path / "t.yaml"
    good.write_text("nvlink:\n  crc_per_second_critical: 50\n")
    assert load_thresholds(good).nvlink.crc_per_second_critical == 50.0
    bad = tmp_path / "bad.yaml"
    bad.write_text("nvlink: [\n")
    with pytest.raises(ThresholdsError, match=r"bad\.yaml: not valid YAML"):
        load_thresholds(bad)
    with pytest.raises(ThresholdsError, match="cannot read"):
        load_thresholds(tmp_path / "missing.yaml")
    cfg = Config()
    assert thresholds_from(SimpleNamespace(extras={}, config=cfg)) is default_thresholds()
    cfg.collectors.thresholds_file = str(good)
    assert thresholds_from(SimpleNamespace(extras={}, config=cfg)).nvlink.crc_per_second_critical == 50.0
    given = dataclasses.replace(Thresholds(), ecc=dataclasses.replace(Thresholds().ecc, dbe_volatile_critical=9))
    assert thresholds_from(SimpleNamespace(extras={"thresholds": given}, config=cfg)) is given


def test_default_values_live_only_in_the_bundled_file():
    # The dataclasses name the keys and their types; a default value beside the YAML's would drift.
    for section in dataclasses.fields(Thresholds):
        for f in dataclasses.fields(getattr(Thresholds(), section.name)):
            assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, \
                f"{section.name}.{f.name} has a default in code: put it in catalog/thresholds.yaml"


def test_a_bundled_file_without_a_key_names_it():
    from gpuhealth.catalog.thresholds import ThresholdsError, _parse

    data = yaml.safe_load((resources.files("gpuhealth") / "catalog" / "thresholds.yaml").read_text())
    del data["nvlink"]["min_window_s"]
    with pytest.raises(ThresholdsError, match=r"nvlink: missing min_window_s"):
        _parse(data, "thresholds.yaml", None)
    del data["host"]
    with pytest.raises(ThresholdsError, match=r"missing section\(s\) host"):
        _parse(data, "thresholds.yaml", None)
