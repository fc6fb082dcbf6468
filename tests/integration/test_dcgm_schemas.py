"""``gpuhealth agent --dcgm-compat`` against dcgm-exporter's own default counters, release by release.

Three agents replay the 2 x H200 recording that has GPM readings (tests/fixtures/recordings/h200x2_gpm.json,
scripts/make_gpm_recording.py says what in it is measured and what synthesized), each serving one schema as an
operator would pick it: ``--dcgm-schema 4.8`` on the command line, nothing (the default, 4.10), and
``GPUHEALTH_AGENT_DCGM_SCHEMA=both``. For each release its default counters (4.8.x: dcgm-exporter's
etc/default-counters.csv of 4.8.2, verbatim; 4.10: the facts in tests/fixtures/dcgm_exporter/schema-4.10.csv) are
compared with the scrape name by name: present, the type dcgm-exporter declares, the unit (the value against the
agent's own base-unit series), and the labels. A real Prometheus then runs dashboard 12239's queries.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_process import AgentProcess, http_get, prometheus_port

from gpuhealth.exporters.dcgm import FIELDS, DcgmField

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parents[1] / "fixtures"
RECORDING = FIXTURES / "recordings" / "h200x2_gpm.json"
COUNTERS_48 = FIXTURES / "dcgm_exporter" / "default-counters.csv"  # dcgm-exporter 4.8.2 (== main d5e5f51)
SCHEMA_410 = FIXTURES / "dcgm_exporter" / "schema-4.10.csv"
DASHBOARD = FIXTURES / "dcgm_dashboard_12239_queries.json"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName")
DRIVER = {"4.8": "DCGM_FI_DRIVER_VERSION", "4.10": "DCGM_FI_SYSTEM_DRIVER_VERSION"}
HOSTNAME = {"4.8": "Hostname", "4.10": "hostname"}
# A default counter NVML cannot give, with the reason; none on this recording (every default is served).
NOT_FROM_NVML: dict[str, dict[str, str]] = {"4.8": {}, "4.10": {}}
# dcgm-exporter's unit as a factor on the agent's base unit (seconds, bytes, joules, hertz, ratios).
UNIT_SCALE = {"MHz": 1e-6, "Hz": 1.0, "C": 1.0, "°C": 1.0, "W": 1.0, "mJ": 1e3, "J": 1.0, "%": 100.0, "ratio": 1.0,
              "MiB": 1 / 2**20, "bytes": 1.0, "bytes/s": 1.0, "ns": 1e9, "KiB": 1 / 1024,
              **dict.fromkeys(("1", "replays", "rows", "errors", "pages", "0/1", "XID code"), 1.0)}
# 4.8.2's file states a unit in the help text "(in X)" or in words; where it states none, DCGM's code decides:
UNIT_48_UNSTATED = {
    # DCGM sums NVML's cumulative NVLINK_THROUGHPUT_DATA_{TX,RX} counters, which NVML counts in KiB
    # (NVIDIA/DCGM dcgmlib/src/DcgmCacheManager.cpp, ReadAndCacheNvLinkBandwidth)
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "KiB",
}


def release_rows(release: str) -> dict[str, tuple[str, str]]:
    """The release's default counters: field → (type, unit)."""
    rows: dict[str, tuple[str, str]] = {}
    if release == "4.8":
        for line in COUNTERS_48.read_text().splitlines():
            parts = [p.strip() for p in line.split(",", 2)]
            if line.startswith("#") or len(parts) != 3 or not parts[0].startswith("DCGM_"):
                continue
            name, kind, help_ = parts
            stated = re.search(r"\(in ([^)]+)\)", help_)
            unit = (stated.group(1) if stated else "bytes/s" if "bytes per second" in help_
                    else "ratio" if "atio" in help_ else UNIT_48_UNSTATED.get(name, "1"))
            rows[name] = (kind, unit)
        return rows
    for line in SCHEMA_410.read_text().splitlines():
        if line.startswith(("#", "field,")) or not line.strip():
            continue
        name, kind, unit, _replaces, _source = line.split(",", 4)
        rows[name] = (kind, unit or "1")
    return rows


def parse(text: str) -> tuple[dict[str, str], dict[str, list[tuple[dict[str, str], float]]]]:
    """Prometheus text format 0.0.4 as written: ``# TYPE`` per family, and every sample's labels and value."""
    types: dict[str, str] = {}
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            name, _, rest = head.partition("{")
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
            series.setdefault(name, []).append((labels, float(value)))
    return types, series


def base_value(series: dict[str, list[tuple[dict[str, str], float]]], field: DcgmField, gpu: str) -> float:
    """The agent's own reading behind ``field`` on ``gpu``, in base units (summed where dcgm sums)."""
    name = next(n for n in (f"gpuhealth_{field.source}", f"gpuhealth_{field.source}_total") if n in series)
    hits = [v for labels, v in series[name]
            if labels.get("gpu") == gpu and all(labels.get(k) == x for k, x in field.match)]
    assert hits and (field.sum_over or len(hits) == 1), (field.name, gpu, hits)
    return sum(hits)


class Stack:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.agents: dict[str, AgentProcess] = {}
        self.prom: subprocess.Popen[bytes] | None = None
        self.prom_url = ""

    def agent(self, schema: str, config: dict[str, Any], env: dict[str, str] | None = None,
              args: tuple[str, ...] = ()) -> None:
        work = self.work / schema
        work.mkdir()
        cfg = work / "agent.yaml"
        cfg.write_text(yaml.safe_dump({
            "collectors": {"fast_interval_s": 1.0, "slow_interval_s": 2.0},
            "agent": {"node_name": "gpu-node-7", "socket_path": str(work / "agent.sock"),
                      "pod_resources_socket": str(work / "no-kubelet.sock"), **config}}))
        self.agents[schema] = AgentProcess(work, ["--config", str(cfg), "--nvml-snapshot", str(RECORDING),
                                                  "--dcgm-compat", *args], env=env)

    def scrape(self, schema: str) -> str:
        code, body = http_get(f"http://127.0.0.1:{self.agents[schema].port}/metrics")
        assert code == 200, body
        return body

    def query(self, promql: str) -> list[dict[str, Any]]:
        code, body = http_get(f"{self.prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        if code != 200:
            return []
        data = json.loads(body)
        assert data["status"] == "success", data
        return data["data"]["result"]  # type: ignore[no-any-return]


def _wait(fn: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("dcgm")
    jobs = work / "slurm-jobs"
    jobs.mkdir()
    (jobs / "1").write_text("4242\n")  # the prolog's file: GPU 1 runs Slurm job 4242
    s = Stack(work)
    try:
        s.agent("4.8", {}, args=("--dcgm-schema", "4.8"))  # the flag (the file key: test_settings_through_commands)
        s.agent("4.10", {"slurm_job_dir": str(jobs)})  # nothing set: the default
        s.agent("both", {}, env={"GPUHEALTH_AGENT_DCGM_SCHEMA": "both"})  # the variable
        (work / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": f"agent-{schema}",
                                "static_configs": [{"targets": [f"127.0.0.1:{agent.port}"],
                                                    "labels": {"instance": f"node-{schema}"}}]}
                               for schema, agent in s.agents.items()],
        }))
        for agent in s.agents.values():
            agent.wait_ready()
        log = (work / "prometheus.log").open("wb")
        s.prom = subprocess.Popen([PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={work / 'tsdb'}", "--web.listen-address=127.0.0.1:0"],
                                  stdout=log, stderr=subprocess.STDOUT)
        s.prom_url = f"http://127.0.0.1:{prometheus_port(work / 'prometheus.log', s.prom)}"
        _wait(lambda: len(s.query("up == 1")) == 3, 60, "Prometheus to scrape the three agents")
        yield s
    finally:
        if s.prom is not None:
            s.prom.terminate()
            s.prom.wait(10)
        for agent in s.agents.values():
            agent.stop()


@pytest.mark.parametrize("release", ["4.8", "4.10"])
def test_each_release_default_counters_by_name_type_unit_and_labels(stack: Stack, release: str) -> None:
    types, series = parse(stack.scrape(release))
    rows = release_rows(release)
    assert len(rows) >= 25, "the release's file parsed"
    fields = {f.name: f for f in FIELDS if release in f.schemas}
    missing = {name for name, (kind, _) in rows.items() if kind != "label" and name not in series}
    assert missing == set(NOT_FROM_NVML[release]), f"{release}: default counters not served: {sorted(missing)}"
    for name, (kind, unit) in rows.items():
        if kind == "label":  # the driver version: a label of every series
            assert name == DRIVER[release]
            continue
        if name in missing:
            continue
        assert types[name] == kind, (release, name, types[name])  # counters typed counter, as dcgm-exporter does
        field = fields[name]
        for labels, value in series[name]:
            assert set(GPU_LABELS) <= set(labels), (name, labels)
            assert labels[HOSTNAME[release]] == "gpu-node-7" and labels[DRIVER[release]] == "580.159.04", labels
            assert DRIVER["4.8" if release == "4.10" else "4.10"] not in labels, (name, labels)
            expected = base_value(series, field, labels["gpu"]) * UNIT_SCALE[unit]
            assert value == pytest.approx(expected, rel=1e-9), (release, name, unit, value, expected)
    # the old names are not in the new schema's scrape, nor the new in the old's
    other = release_rows("4.10" if release == "4.8" else "4.8")
    stale = {n for n, (kind, _) in other.items() if kind != "label" and n not in rows and n in series}
    assert not stale, stale


def test_both_schemas_at_once_carry_both_driver_labels(stack: Stack) -> None:
    types, series = parse(stack.scrape("both"))
    for release in ("4.8", "4.10"):
        for name, (kind, _) in release_rows(release).items():
            if kind != "label":
                assert name in series and types[name] == kind, (release, name)
    for name, samples in series.items():
        if name.startswith("DCGM_"):
            for labels, _ in samples:
                assert labels["DCGM_FI_DRIVER_VERSION"] == labels["DCGM_FI_SYSTEM_DRIVER_VERSION"] == "580.159.04"


def test_the_gpu_running_a_slurm_job_carries_hpc_job_as_dcgm_exporter_names_it(stack: Stack) -> None:
    _, series = parse(stack.scrape("4.10"))
    [(labels, _)] = [x for x in series["DCGM_FI_DEV_GPU_TEMP_CELSIUS"] if x[0]["gpu"] == "1"]
    assert labels["hpc_job"] == "4242" and "slurm_job_id" not in labels
    # our own series keep our name for it
    [(ours, _)] = [x for x in series["gpuhealth_gpu_info"] if x[0]["gpu"] == "1"]
    assert ours["slurm_job_id"] == "4242"


def _panels() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = [(p["title"], p["expr"]) for p in dash["panels"]]
    for var in dash["variables"]:
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"])
        assert m, var["query"]
        out.append((f"variable {var['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    return out


@pytest.mark.parametrize("schema", ["4.8", "both"])
@pytest.mark.parametrize("panel", [title for title, _ in _panels()])
def test_dashboard_12239_has_data_on_every_panel(stack: Stack, schema: str, panel: str) -> None:
    """Dashboard 12239 as dcgm-exporter ships it (its queries use the 4.5-4.8 names) on the recording with GPM
    readings: every panel, the Tensor Core one included, has one series per GPU (or one for an aggregate)."""
    expr = dict(_panels())[panel].replace("$instance", f"node-{schema}").replace("$gpu", ".+")
    result = _wait(lambda: stack.query(expr), 30, f"panel {panel}")
    if panel == "variable instance":  # over every target: those serving 4.8's names (the 4.10 one serves new ones)
        assert {r["metric"]["instance"] for r in result} == {"node-4.8", "node-both"}
        return
    aggregate = panel in ("GPU Avg. Temp", "GPU Power Total")
    assert len(result) == (1 if aggregate else 2), result
    if panel == "Tensor Core Utilization":  # GPU 0: measured idle; GPU 1: synthesized under load (63 %)
        assert sorted(float(r["value"][1]) for r in result) == [0.0, 0.63]
    if panel == "GPU SM Clocks":  # MHz x 10^6 on the panel = the recorded clock in Hz
        rec = json.loads(RECORDING.read_text())
        assert sorted(float(r["value"][1]) for r in result) == sorted(
            d["ClockInfo_SM"]["value"] * 1e6 for d in rec["devices"])
