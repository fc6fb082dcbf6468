"""The Helm chart, loaded once per test module by Helm's own engine (helm-python-sdk)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest
from chart_docs import CHART


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART) as c:
        yield c
