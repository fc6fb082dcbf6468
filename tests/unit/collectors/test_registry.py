"""The one explicit list of collectors: every module is there and builds a working collector."""

from __future__ import annotations

import pytest

from gpuhealth.collectors.base import Collector, Lane
from gpuhealth.collectors.registry import COLLECTOR_MODULES, UnknownCollector, all_collectors
from gpuhealth.config import Config


def test_every_registered_module_creates_a_collector_of_its_name() -> None:
    collectors = all_collectors(Config())
    assert [c.name for c in collectors] == list(COLLECTOR_MODULES)
    for c in collectors:
        assert isinstance(c, Collector) and c.lane in (Lane.FAST, Lane.SLOW)
    assert all_collectors(Config())[2] is not collectors[2]  # fresh instances: state is per agent


def test_disabled_collectors_are_left_out_and_typos_are_errors() -> None:
    cfg = Config()
    cfg.collectors.disabled = ["nvlink", "host"]
    assert "nvlink" not in [c.name for c in all_collectors(cfg)]
    cfg.collectors.disabled = ["nvlnk"]
    with pytest.raises(UnknownCollector, match="nvlnk"):
        all_collectors(cfg)
