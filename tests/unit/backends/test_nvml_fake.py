from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuhealth.backends import errors
from gpuhealth.backends.errors import NvmlError, RecordingError
from gpuhealth.backends.nvml_fake import FakeNvml


def test_replays_real_recording_as_is(h200_recording: Path) -> None:
    fake = FakeNvml.from_file(h200_recording)
    fake.init()
    assert fake.device_count() == 2
    assert fake.query(0, "Name") == "NVIDIA H200"
    assert fake.query(0, "MemoryInfo")["total"] == 150754820096
    assert fake.nvlink(0, 0, "state") == 1
    assert fake.system("driver") == "580.159.04"
    with pytest.raises(NvmlError) as exc:
        fake.query(0, "NumaNodeId")
    assert exc.value.not_supported


def test_field_values_batch_serves_device_and_per_link_fields(h200_recording: Path) -> None:
    fake = FakeNvml.from_file(h200_recording)
    fake.init()
    temp, crc_link3, bogus = fake.field_values(
        0, [("NVML_FI_DEV_MEMORY_TEMP", 0), ("NVML_FI_DEV_NVLINK_ERROR_DL_CRC", 3), ("NVML_FI_DEV_NOPE", 0)]
    )
    assert temp == 39
    assert crc_link3 == fake.nvlink(0, 3, "err_DL_CRC_FLIT")
    assert isinstance(bogus, NvmlError) and bogus.not_supported


def test_scenario_overrides_clones_and_events(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    scenario = {
        "recording": "nvml_h200x2.json",
        "gpu_count": 8,
        "overrides": {"3": {"CurrPcieLinkWidth": 8, "PcieReplayCounter": {"ramp": 10}, "nvlink": {"2": {"state": 0}}}},
        "events": [
            {"at": 5, "type": "xid", "gpu": 1, "xid": 79},
            {"at": 10, "type": "lost", "gpu": 2},
            {"at": 20, "type": "driver_unloaded", "until": 30},
        ],
    }
    path = tmp_path / "s.json"
    path.write_text(json.dumps(scenario))
    fake = FakeNvml.from_file(path, clock=clock)
    fake.init()
    assert fake.device_count() == 8
    uuids = {fake.query(i, "UUID") for i in range(8)}
    assert len(uuids) == 8
    assert fake.query(3, "CurrPcieLinkWidth") == 8
    assert fake.nvlink(3, 2, "state") == 0
    clock.advance(6)
    assert fake.query(3, "PcieReplayCounter") == 60
    events = fake.wait_xid_events(10)
    assert [(e.gpu_index, e.xid) for e in events] == [(1, 79)]
    clock.advance(5)
    with pytest.raises(NvmlError) as lost:
        fake.query(2, "Name")
    assert lost.value.code == errors.GPU_IS_LOST
    assert fake.query(1, "Name") == "NVIDIA H200"
    clock.advance(10)
    with pytest.raises(NvmlError) as gone:
        fake.device_count()
    assert gone.value.driver_gone
    with pytest.raises(NvmlError):
        fake.init()
    clock.advance(11)
    fake.init()
    assert fake.device_count() == 8


def test_a_slow_gpu_answers_late_until_restored(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    import time

    scenario = {"recording": "nvml_h200x2.json",
                "events": [{"at": 5, "type": "slow", "gpu": 0, "seconds": 0.2},
                           {"at": 10, "type": "restore", "gpu": 0}]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(scenario))
    fake = FakeNvml.from_file(path, clock=clock)
    fake.init()

    def took(gpu: int) -> float:
        t0 = time.perf_counter()
        fake.query(gpu, "Name")
        return time.perf_counter() - t0

    assert took(0) < 0.1
    clock.advance(6)
    assert took(0) >= 0.2 and took(1) < 0.1  # only the slow GPU's calls wait
    clock.advance(5)
    assert took(0) < 0.1
    path.write_text(json.dumps({"recording": "nvml_h200x2.json", "events": [{"type": "slow", "gpu": 0}]}))
    with pytest.raises(RecordingError, match=r"seconds"):
        FakeNvml.from_file(path)


def test_malformed_files_name_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RecordingError, match=r"bad\.json"):
        FakeNvml.from_file(bad)
    no_uuid = tmp_path / "nouuid.json"
    no_uuid.write_text(json.dumps({"devices": [{"Name": {"value": "x"}, "PciInfo": {"value": {}}}]}))
    with pytest.raises(RecordingError, match=r"devices\[0\]: missing key 'UUID'"):
        FakeNvml.from_file(no_uuid)
    scen = tmp_path / "scen.yaml"
    scen.write_text("recording: nvml_h200x2.json\noverrides: {'9': {Name: x}}\n")
    with pytest.raises(RecordingError, match="GPU 9 does not exist"):
        FakeNvml.from_file(scen)


def test_per_link_fields_on_link_0_follow_link_overrides(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "recording: nvml_h200x2.json\noverrides: {'0': {nvlink: {'0': {err_DL_CRC_FLIT: 77, state: 0}}}}\n")
    fake = FakeNvml.from_file(scenario)
    fake.init()
    crc0, state0, state1 = fake.field_values(
        0, [("NVML_FI_DEV_NVLINK_ERROR_DL_CRC", 0), ("NVML_FI_DEV_NVLINK_GET_STATE", 0),
            ("NVML_FI_DEV_NVLINK_GET_STATE", 1)])
    assert (crc0, state0, state1) == (77, 0, 1)
