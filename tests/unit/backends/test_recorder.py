"""``gpuhealth record`` round trip: recording → pynvml-shaped driver → recorder → recording.

``RecordedDriver`` speaks the ``pynvml`` API the recorder uses (ctypes-like structs, NVMLError with
``.value``), answering from a real recording through ``FakeNvml``: the hardware boundary, replayed.
The new file must load in ``FakeNvml`` as is and give the same answers and the same report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from gpuhealth.backends import errors
from gpuhealth.backends.errors import NvmlError
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.backends.recorder import Recorder, anonymize
from gpuhealth.cli.main import cli
from gpuhealth.config import Config
from gpuhealth.node import collect_once, open_backend


class _Struct:
    """Quacks like a ctypes structure for ``plain()``: ``_fields_`` plus attributes."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._fields_ = [(k, None) for k in data]
        for k, v in data.items():
            setattr(self, k, _struct(v))


def _struct(v: Any) -> Any:
    if isinstance(v, dict):
        return _Struct(v)
    if isinstance(v, list):
        return [_struct(x) for x in v]
    return v


class RecordedDriver:
    """The subset of ``pynvml`` the recorder calls, served from a recording."""

    class NVMLError(Exception):
        def __init__(self, value: int, text: str = "") -> None:
            super().__init__(text or f"NVML error {value}")
            self.value = value

    NVML_TEMPERATURE_GPU = "GPU"
    NVML_NVLINK_MAX_LINKS = 18
    NVML_AFFINITY_SCOPE_NODE = 0
    NVML_PCIE_UTIL_TX_BYTES = "TX"
    NVML_PCIE_UTIL_RX_BYTES = "RX"
    NVML_VOLATILE_ECC = "VOLATILE"
    NVML_AGGREGATE_ECC = "AGGREGATE"
    NVML_MEMORY_ERROR_TYPE_CORRECTED = "CORRECTED"
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = "UNCORRECTED"
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = "SBE"
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = "DBE"
    NVML_P2P_CAPS_INDEX_NVLINK = 0
    NVML_P2P_CAPS_INDEX_READ = 1
    NVML_FI_DEV_MEMORY_TEMP = 82
    NVML_FI_DEV_ECC_DBE_VOL_TOTAL = 4
    nvmlMemory_v2 = "v2"
    nvmlEventTypeXidCriticalError = 8
    nvmlEventTypeDoubleBitEccError = 2
    nvmlEventTypeSingleBitEccError = 1
    for _n in ("SLOWDOWN", "SHUTDOWN", "GPU_MAX", "MEM_MAX"):
        locals()["NVML_TEMPERATURE_THRESHOLD_" + _n] = _n
    for _n in ("GRAPHICS", "SM", "MEM"):
        locals()["NVML_CLOCK_" + _n] = _n
    for _n in ("POWER", "THERMAL", "SYNC_BOOST", "BOARD_LIMIT", "LOW_UTILIZATION", "RELIABILITY"):
        locals()["NVML_PERF_POLICY_" + _n] = _n
    for _n in ("DL_REPLAY", "DL_RECOVERY", "DL_CRC_FLIT", "DL_CRC_DATA", "DL_ECC_DATA"):
        locals()["NVML_NVLINK_ERROR_" + _n] = _n

    def __init__(self, fake: FakeNvml) -> None:
        self.fake = fake

    def _q(self, fn: Any, *args: Any) -> Any:
        try:
            return _struct(fn(*args))
        except NvmlError as exc:
            raise self.NVMLError(exc.code, exc.message) from exc

    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvmlDeviceGet"):
            key = name[len("nvmlDeviceGet"):]
            return lambda h: self._q(self.fake.query, h, key)
        raise AttributeError(name)

    def nvmlInit(self) -> None:
        self.fake.init()

    def nvmlShutdown(self) -> None:
        self.fake.shutdown()

    def nvmlSystemGetDriverVersion(self) -> Any:
        return self._q(self.fake.system, "driver")

    def nvmlSystemGetNVMLVersion(self) -> Any:
        return self._q(self.fake.system, "nvml_version")

    def nvmlSystemGetCudaDriverVersion_v2(self) -> Any:
        return self._q(self.fake.system, "cuda_driver")

    def nvmlDeviceGetCount(self) -> int:
        return self.fake.device_count()

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def c_nvmlGpuFabricInfo_t(self) -> Any:
        return None

    def nvmlDeviceGetGpuFabricInfo(self, h: int, ref: Any) -> None:
        raise self.NVMLError(errors.NOT_SUPPORTED, "Not Supported")

    def nvmlDeviceGetMemoryInfo(self, h: int, version: Any = None) -> Any:
        return self._q(self.fake.query, h, "MemoryInfo_v2" if version else "MemoryInfo")

    def nvmlDeviceGetTemperature(self, h: int, c: str) -> Any:
        return self._q(self.fake.query, h, "Temperature_" + c)

    def nvmlDeviceGetTemperatureThreshold(self, h: int, c: str) -> Any:
        return self._q(self.fake.query, h, "TemperatureThreshold_" + c)

    def nvmlDeviceGetClockInfo(self, h: int, c: str) -> Any:
        return self._q(self.fake.query, h, "ClockInfo_" + c)

    def nvmlDeviceGetMaxClockInfo(self, h: int, c: str) -> Any:
        return self._q(self.fake.query, h, "MaxClockInfo_" + c)

    def nvmlDeviceGetTotalEccErrors(self, h: int, et: str, ct: str) -> Any:
        return self._q(self.fake.query, h, f"TotalEccErrors_{et}_{ct}")

    def nvmlDeviceGetRetiredPages(self, h: int, src: str) -> Any:
        return self._q(self.fake.query, h, "RetiredPages_" + src)

    def nvmlDeviceGetViolationStatus(self, h: int, pol: str) -> Any:
        return self._q(self.fake.query, h, "ViolationStatus_" + pol)

    def nvmlDeviceGetCpuAffinity(self, h: int, n: int) -> Any:
        return self._q(self.fake.query, h, "CpuAffinity_64x4")

    def nvmlDeviceGetMemoryAffinity(self, h: int, n: int, scope: int) -> Any:
        return self._q(self.fake.query, h, "MemoryAffinity_64x4")

    def nvmlDeviceGetPcieThroughput(self, h: int, c: str) -> Any:
        return self._q(self.fake.query, h, "PcieThroughput_" + c)

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> Any:
        return self._q(self.fake.nvlink, h, link, "state")

    def nvmlDeviceGetNvLinkVersion(self, h: int, link: int) -> Any:
        return self._q(self.fake.nvlink, h, link, "version")

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        return self._q(self.fake.nvlink, h, link, "remote_pci")

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> Any:
        return self._q(self.fake.nvlink, h, link, "remote_type")

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, c: str) -> Any:
        return self._q(self.fake.nvlink, h, link, "err_" + c)

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[int]) -> list[Any]:
        names = {v: k for k, v in vars(RecordedDriver).items() if k.startswith("NVML_FI_DEV_")}
        out = []
        for fid, res in zip(ids, self.fake.field_values(h, [(names[f], 0) for f in ids]), strict=True):
            ok = not isinstance(res, NvmlError)
            out.append(_Struct({"fieldId": fid, "nvmlReturn": 0 if ok else res.code, "valueType": 1,
                                "value": {"uiVal": res if ok else 0}}))
        return out

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, h: int, mask: int, es: object) -> None:
        return None

    def nvmlEventSetWait_v2(self, es: object, timeout_ms: int) -> Any:
        raise self.NVMLError(errors.TIMEOUT, "Timeout")

    def nvmlEventSetFree(self, es: object) -> None:
        return None

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return 30

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, idx: int) -> int:
        return 0


def _sysfs_tree(root: Path, fake: FakeNvml) -> None:
    for i in range(fake.device_count()):
        sysfs = fake.query(i, "sysfs")
        d = root / "sys" / "bus" / "pci" / "devices" / sysfs["bdf"]
        d.mkdir(parents=True)
        for k, v in sysfs.items():
            if k != "bdf":
                (d / k).write_text(str(v) + "\n")


def test_recorder_output_replays_the_same_answers(tmp_path: Path, h200_recording: Path) -> None:
    source = FakeNvml.from_file(h200_recording)
    source.init()
    _sysfs_tree(tmp_path / "root", source)
    data = Recorder(RecordedDriver(FakeNvml.from_file(h200_recording)), reps=2,
                    sysfs_root=str(tmp_path / "root")).record()
    out = tmp_path / "rec.json"
    out.write_text(json.dumps(data))
    replay = FakeNvml.from_file(out)
    replay.init()
    assert data["format"] == "NVML recording v1"
    assert replay.device_count() == 2 and replay.system("driver") == "580.159.04"
    for i in range(2):
        for key in ("UUID", "PciInfo", "MemoryInfo", "RemappedRows", "ViolationStatus_POWER", "Temperature_GPU",
                    "TotalEccErrors_UNCORRECTED_VOLATILE", "ClockInfo_SM", "CpuAffinity_64x4", "sysfs"):
            assert replay.query(i, key) == source.query(i, key), key
        assert replay.nvlink(i, 3, "err_DL_CRC_FLIT") == source.nvlink(i, 3, "err_DL_CRC_FLIT")
        entry = data["devices"][i]["NumaNodeId"]
        assert entry == {"error": "Not Supported", "code": 3}  # errors keep NVML's text and code
        assert data["devices"][i]["Temperature_GPU"]["median_us"] >= 0
    cfg = Config()
    cfg.agent.node_name = "n"
    cfg.collectors.disabled = ["host"]
    a = collect_once(open_backend(str(out)), cfg).to_dict()
    b = collect_once(open_backend(str(h200_recording)), cfg).to_dict()
    # the recording also says where it was made (the test's tree: unknown); the source recording does not
    assert data["environment"]["value"]["kind"] == a["node"]["environment"]["kind"] == "unknown"
    assert a["gpus"] == b["gpus"]
    assert [f for f in a["findings"] if f["code"] != "fabric.manager_unobserved"] == \
        [f for f in b["findings"] if f["code"] != "fabric.manager_unobserved"]


def test_anonymize_replaces_board_identifiers(h200_recording: Path) -> None:
    data = json.loads(h200_recording.read_text())
    anonymize(data)
    uuids = [d["UUID"]["value"] for d in data["devices"]]
    assert len(set(uuids)) == 2 and all(u.startswith("GPU-") for u in uuids)
    assert "1111-2222" not in uuids[0] and data["anonymized"] is True


def test_record_without_a_driver_is_one_clear_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["record", str(tmp_path / "out.json")])
    if result.exit_code == 3:  # no NVIDIA driver here (CI, laptops)
        assert result.output.startswith("gpuhealth record: ") and len(result.output.splitlines()) == 1
        assert not (tmp_path / "out.json").exists()
    else:  # a GPU node: the file was written and loads
        assert result.exit_code == 0
        FakeNvml.from_file(tmp_path / "out.json").init()
    assert "Traceback" not in result.output


def test_failed_getters_are_recorded_with_their_code(tmp_path: Path, h100_recording: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"recording": "nvml_h100x1.json",
                                "overrides": {"0": {"PowerUsage": {"error": "GPU is lost", "code": 15}}}}))
    source = FakeNvml.from_file(h100_recording)
    source.init()
    _sysfs_tree(tmp_path / "root", source)
    data = Recorder(RecordedDriver(FakeNvml.from_file(path)), reps=1, sysfs_root=str(tmp_path / "root")).record()
    assert data["devices"][0]["PowerUsage"] == {"error": "GPU is lost", "code": 15}
    assert data["devices"][0]["sweep10_median_us"] is None  # one getter of the sweep failed: no crash
    assert data["devices"][0]["sysfs"]["current_link_width"] == "16"
    assert data["topology"] == {}  # one GPU: no pair to relate


def test_one_element_tuple_constants_of_the_bindings_are_unwrapped() -> None:
    from types import SimpleNamespace

    from gpuhealth.backends.nvml_keys import nvml_const

    bindings = SimpleNamespace(NVML_P2P_CAPS_INDEX_READ=(0,), NVML_P2P_CAPS_INDEX_NVLINK=2)
    assert nvml_const(bindings, "NVML_P2P_CAPS_INDEX_READ") == 0
    assert nvml_const(bindings, "NVML_P2P_CAPS_INDEX_NVLINK") == 2
