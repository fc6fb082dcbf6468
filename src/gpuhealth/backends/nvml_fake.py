"""A GPU backend that replays an "NVML recording v1" file, plus scenario overrides and timed events.

Recordings are loaded as they are (``tools/nvml_record.py`` / ``gpuhealth record`` write them).
A *scenario* (YAML or JSON) names a recording and changes it:

```yaml
recording: nvml_h200x2.json     # path relative to the scenario file, or a bundled name
gpu_count: 8                    # optional: clone recorded GPUs cyclically (unique UUIDs, bus ids)
overrides:                      # per GPU index: recording keys → replacement
  "1":
    CurrPcieLinkWidth: 8                       # shorthand for {"value": 8}
    NumaNodeId: {error: "Not Supported", code: 3}
    PcieReplayCounter: {ramp: 50}              # recorded value + 50 per second since start
    nvlink: {"3": {state: 0}}
    field_values: {NVML_FI_DEV_MEMORY_TEMP: 99}
    sysfs: {current_link_width: "8"}
events:                         # applied when the scenario clock passes ``at`` (seconds)
  - {at: 5, type: xid, gpu: 0, xid: 79}
  - {at: 8, type: set, gpu: 1, key: TotalEccErrors_UNCORRECTED_VOLATILE, value: 2}
  - {at: 10, type: lost, gpu: 1}               # every call on GPU 1 → GPU_IS_LOST
  - {at: 12, type: slow, gpu: 0, seconds: 3}   # every call on GPU 0 answers 3 s late (a GPU in trouble)
  - {at: 15, type: restore, gpu: 0}            # GPU answers again, promptly
  - {at: 20, type: driver_unloaded, until: 30} # init/all calls fail, then recover
kmsg: ["NVRM: Xid (PCI:0000:00:06): 79, pid=0, GPU has fallen off the bus."]
system:                         # node-wide recording keys → replacement (same shorthand as overrides)
  fabric_manager: stopped
  environment: {virtualization: none, container: false, host_pid_namespace: true, nvswitches_visible: 4}
  other_pci_gpus:               # NVIDIA GPUs on the host's PCI bus that the recording's NVML does not list
    - {bdf: "0000:40:00.0", driver: nvidia, minor: 2, device_node: refused}  # listed by the driver, cgroup says no
    - {bdf: "0000:50:00.0", driver: nvidia}   # no minor: not in this view's /proc/driver/nvidia/gpus
    - {bdf: "0000:60:00.0", driver: null}     # bound to no driver (the driver failed to probe it)
```
The clock is injected (``clock``), so tests step time without sleeping.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from gpuhealth.backends import errors
from gpuhealth.backends.base import NVLINK_MAX_LINKS, FieldResult, XidEvent
from gpuhealth.backends.errors import NvmlError, RecordingError
from gpuhealth.backends.plausible import check_field, check_nvlink, check_reading

BUNDLED_RECORDINGS = ("nvml_h200x2.json", "nvml_h100x1.json")
MAX_FILE_BYTES = 64 << 20  # a recording or scenario file, read whole
MAX_GPUS = 256  # ``gpu_count`` of a scenario: more than any node has (a clone costs ~100 KiB)
MAX_EVENTS = 100_000
MAX_KMSG_LINES = 100_000
MAX_RECORDED_LINKS = 64  # the recorder probes past NVML's link count (36 on a recording of an H200)
DEFAULT_RECORDING = "nvml_h200x2.json"
# Node-wide keys a scenario's ``system`` may replace (what ``FakeNvml.system`` answers besides the driver's).
SYSTEM_KEYS = ("driver", "nvml_version", "cuda_driver", "fabric_manager", "environment", "other_pci_gpus")
HOST_KEYS = ("fabric_manager", "environment", "other_pci_gpus")  # read from the host, not from NVML
_DEVICE_NODE_STATES = ("present", "absent", "refused")  # /dev/nvidia<minor> of an ``other_pci_gpus`` entry

# Per-link field ids served from the recording's per-link counters (scope = link number).
_PER_LINK_FIELDS = {
    "NVML_FI_DEV_NVLINK_ERROR_DL_CRC": "err_DL_CRC_FLIT",
    "NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY": "err_DL_REPLAY",
    "NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY": "err_DL_RECOVERY",
    "NVML_FI_DEV_NVLINK_GET_STATE": "state",
    "NVML_FI_DEV_NVLINK_GET_VERSION": "version",
}
_NVLINK_ERROR_FIELD_PREFIXES = {
    "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L": "err_DL_CRC_FLIT",
    "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L": "err_DL_CRC_DATA",
    "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_L": "err_DL_REPLAY",
    "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_L": "err_DL_RECOVERY",
    "NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_L": "err_DL_ECC_DATA",
}


def bundled_recording_path(name: str = DEFAULT_RECORDING) -> Path:
    """Path of a real recording shipped inside the package (``gpuhealth/data``)."""
    ref = resources.files("gpuhealth") / "data" / name
    return Path(str(ref))


def _load_structured(path: Path) -> Any:
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise RecordingError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise RecordingError(f"{path}: over {MAX_FILE_BYTES >> 20} MiB; a recording of a node is a few hundred KiB")
    is_yaml = path.suffix in (".yaml", ".yml")
    kind = "YAML" if is_yaml else "JSON"
    try:
        text = raw.decode("utf-8")
        return yaml.safe_load(text) if is_yaml else json.loads(text)
    except UnicodeDecodeError as exc:
        raise RecordingError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise RecordingError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise RecordingError(f"{path}: not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
    except RecursionError:
        raise RecordingError(f"{path}: not valid {kind}: nested too deeply") from None


def _error_code(entry: Mapping[str, Any], where: str) -> int | None:
    """The NVML return code of an ``{"error": …, "code": N}`` entry (None: the recorder's own failure)."""
    code = entry.get("code", entry.get("ret"))
    if code is None:
        return None
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 0xFFFF:
        raise RecordingError(f"{where}: 'code' must be an NVML return code (an integer), got {code!r:.40}")
    return code


def _copy_json(value: Any) -> Any:
    """A copy of parsed JSON (dicts, lists, scalars) the caller may change: several times faster than
    ``copy.deepcopy``, which the sysfs and NVLink reads of every sweep paid for."""
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_json(v) for v in value]
    return value


def _answer(entry: Any, where: str) -> Any:
    """Turn one recorded ``{"value": …}`` / ``{"error": …, "code": …}`` entry into a value or raise."""
    if isinstance(entry, Mapping):
        if "value" in entry:
            return entry["value"]
        if "error" in entry:
            code = _error_code(entry, where)
            if code is None:  # the recorder's own failure (bindings), not NVML: treat as unsupported
                raise NvmlError(errors.NOT_SUPPORTED, f"not recorded: {entry['error']}")
            raise NvmlError(code, str(entry["error"])[:200])
    raise RecordingError(f"{where}: expected {{'value': …}} or {{'error': …, 'code': …}}, got {entry!r:.80}")


def _check_entry(entry: Any, where: str) -> None:
    """A recorded reading has the shape ``_answer`` needs (checked at load: a bad file fails at once)."""
    if not isinstance(entry, Mapping) or not ({"value", "error"} & set(entry)):
        raise RecordingError(f"{where}: expected {{'value': …}} or {{'error': …, 'code': …}}, got {entry!r:.80}")
    if "value" not in entry:
        _error_code(entry, where)


def _check_device(dev: Any, where: str) -> None:
    if not isinstance(dev, Mapping):
        raise RecordingError(f"{where} must be an object")
    for key, entry in dev.items():
        at = f"{where}.{key}"
        if not isinstance(key, str):
            raise RecordingError(f"{where}: key {key!r:.40} is not text")
        if key == "nvlink":
            _check_links(entry, at)
        elif key == "field_values":
            fields = entry.get("fields") if isinstance(entry, Mapping) else None
            if not isinstance(fields, Mapping):
                raise RecordingError(f"{at}: expected {{'fields': {{NVML_FI_NAME: …}}}}")
            for name, fv in fields.items():
                if not isinstance(fv, Mapping) or not ({"value", "ret", "error"} & set(fv)):
                    raise RecordingError(f"{at}.fields.{name}: expected {{'value': …}} or {{'ret': CODE}}")
                if "value" not in fv:
                    _error_code(fv, f"{at}.fields.{name}")
        elif key == "sysfs":
            _check_sysfs(entry, at)
        elif isinstance(entry, Mapping) and ({"value", "error"} & set(entry)):
            _check_entry(entry, at)
        # else: recorder metadata (timings, notes) that no key reads


def _check_links(links: Any, where: str) -> None:
    if not isinstance(links, Mapping):
        raise RecordingError(f"{where}: expected {{LINK: {{KEY: ENTRY}}}}")
    for link, entries in links.items():
        if not str(link).isdigit() or int(str(link)) >= MAX_RECORDED_LINKS:
            raise RecordingError(f"{where}: link {link!r:.20} is not 0..{MAX_RECORDED_LINKS - 1}")
        if not isinstance(entries, Mapping):
            raise RecordingError(f"{where}.{link}: expected {{KEY: ENTRY}}")
        if ({"value", "error"} & set(entries)) and not any(isinstance(v, Mapping) for v in entries.values()):
            _check_entry(entries, f"{where}.{link}")  # one error stored for the whole link
            continue
        for key, entry in entries.items():
            if isinstance(entry, Mapping):
                _check_entry(entry, f"{where}.{link}.{key}")
            elif key not in ("error", "code"):
                raise RecordingError(f"{where}.{link}.{key}: expected {{'value': …}} or {{'error': …}}")


def _check_sysfs(sysfs: Any, where: str) -> None:
    if not isinstance(sysfs, Mapping):
        raise RecordingError(f"{where}: expected {{FILE: TEXT}}")
    for name, value in sysfs.items():
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) or len(str(value)) > 4096:
            raise RecordingError(f"{where}.{name}: expected a line of text, got {value!r:.40}")


def _check_other_pci_gpus(value: Any, where: str) -> None:
    """``system.other_pci_gpus``: what sysfs, the driver's GPU list and /dev say about GPUs NVML does not list."""
    if not isinstance(value, list) or len(value) > MAX_GPUS:
        raise RecordingError(f"{where}: expected a list of at most {MAX_GPUS} {{bdf, driver, minor, device_node}}")
    for n, gpu in enumerate(value):
        at = f"{where}[{n}]"
        if not isinstance(gpu, Mapping) or not set(gpu) <= {"bdf", "driver", "minor", "device_node"}:
            raise RecordingError(f"{at}: expected {{bdf, driver, minor, device_node}}")
        bdf = gpu.get("bdf")
        if not isinstance(bdf, str) or bdf.count(":") != 2 or "." not in bdf:
            raise RecordingError(f"{at}.bdf: expected a PCI address such as 0000:40:00.0, got {bdf!r:.40}")
        if gpu.get("driver") is not None and not isinstance(gpu.get("driver"), str):
            raise RecordingError(f"{at}.driver: expected a kernel driver's name or null")
        minor = gpu.get("minor")
        if minor is not None and (isinstance(minor, bool) or not isinstance(minor, int) or not 0 <= minor < 256):
            raise RecordingError(f"{at}.minor: expected the device minor (0..255) or null, got {minor!r:.40}")
        if gpu.get("device_node", "present") not in _DEVICE_NODE_STATES:
            raise RecordingError(f"{at}.device_node: expected one of {', '.join(_DEVICE_NODE_STATES)}")


def _normalise_override(value: Any, where: str = "override") -> dict[str, Any]:
    """An override as a recorded entry: a bare value is ``{"value": v}``; a ramp's rate is a finite
    number; an error has an NVML code."""
    if isinstance(value, Mapping) and ({"value", "error", "ramp"} & set(value)):
        entry = dict(value)
        if "ramp" in entry:
            rate = entry["ramp"]
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate):
                raise RecordingError(f"{where}: 'ramp' must be a finite number per second, got {rate!r:.40}")
        elif "value" not in entry:
            _error_code(entry, where)
        return entry
    return {"value": value}


@dataclass(frozen=True, slots=True)
class _Event:
    at: float
    type: str
    gpu: int | None
    data: Mapping[str, Any]


_EVENT_TYPES = frozenset({"xid", "set", "lost", "slow", "driver_unloaded", "restore"})
MAX_SLOW_S = 3600.0  # a ``slow`` event's delay per call


def _index(value: Any, where: str) -> int:
    """A GPU index or count: an integer (or its digits), never a bool or a float."""
    if isinstance(value, bool):
        raise RecordingError(f"{where}: expected an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit() and len(value) < 10:
        return int(value)
    raise RecordingError(f"{where}: expected an integer")


def _check_override(key: Any, val: Any, where: str) -> None:
    """One override (or ``set`` event): the forms ``_apply_override`` applies."""
    if not isinstance(key, str) or not key:
        raise RecordingError(f"{where}: the key must be a recording key (text)")
    if key == "nvlink":
        if not isinstance(val, Mapping) or not all(
                str(link).isdigit() and int(str(link)) < MAX_RECORDED_LINKS and isinstance(kv, Mapping)
                for link, kv in val.items()):
            raise RecordingError(f"{where}: expected {{LINK (0..{MAX_RECORDED_LINKS - 1}): {{KEY: VALUE}}}}")
        for link, kv in val.items():
            for lk, lv in kv.items():
                _normalise_override(lv, f"{where}.{link}.{lk}")
    elif key == "field_values":
        if not isinstance(val, Mapping):
            raise RecordingError(f"{where}: expected {{NVML_FI_NAME: VALUE}}")
        for name, fv in val.items():
            _normalise_override(fv, f"{where}.{name}")
    elif key == "sysfs":
        _check_sysfs(val, where)
    else:
        _normalise_override(val, where)


def _event(ev: Any, where: str) -> _Event:
    if not isinstance(ev, Mapping) or ev.get("type") not in _EVENT_TYPES:
        raise RecordingError(f"{where}: 'type' must be one of {sorted(_EVENT_TYPES)}")
    at = ev.get("at", 0)
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not 0 <= at < math.inf:
        raise RecordingError(f"{where}.at: expected seconds (a finite number >= 0), got {at!r:.40}")
    gpu = ev.get("gpu")
    index = None if gpu is None else _index(gpu, f"{where}.gpu {gpu!r:.40}")
    kind = str(ev["type"])
    if kind in ("set", "lost", "slow", "restore") and index is None:
        raise RecordingError(f"{where}: a '{kind}' event needs 'gpu'")
    if kind == "xid":
        xid = ev.get("xid", 0)
        if isinstance(xid, bool) or not isinstance(xid, int) or not 0 <= xid < 1 << 31:
            raise RecordingError(f"{where}.xid: expected an XID number, got {xid!r:.40}")
    if kind == "set":
        _check_override(ev.get("key"), ev.get("value"), f"{where} (set {ev.get('key')!r:.40})")
    if kind == "slow":
        secs = ev.get("seconds")
        if isinstance(secs, bool) or not isinstance(secs, (int, float)) or not 0 <= secs <= MAX_SLOW_S:
            raise RecordingError(f"{where}.seconds: expected seconds per call (0..{MAX_SLOW_S:g}), got {secs!r:.40}")
    if kind == "driver_unloaded" and ev.get("until") is not None:
        until = ev["until"]
        if isinstance(until, bool) or not isinstance(until, (int, float)) or not 0 <= until < math.inf:
            raise RecordingError(f"{where}.until: expected seconds (a finite number), got {until!r:.40}")
    return _Event(float(at), kind, index, dict(ev))


class FakeNvml:
    """Replays a recording. Thread-safe enough for one poller plus the XID event thread."""

    def __init__(
        self,
        recording: Mapping[str, Any],
        *,
        source: str = "recording",
        overrides: Mapping[int, Mapping[str, Any]] | None = None,
        events: Sequence[_Event] = (),
        gpu_count: int | None = None,
        kmsg_lines: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._clock = clock
        self._lock = threading.Lock()
        self._check_recording(recording, source)
        self._recording = recording
        devices = list(recording["devices"])
        if gpu_count is not None and not 1 <= gpu_count <= MAX_GPUS:
            raise RecordingError(f"{source}: gpu_count must be 1..{MAX_GPUS}, got {gpu_count}")
        if gpu_count is not None and gpu_count != len(devices):
            devices = [self._clone(devices[i % len(devices)], i) for i in range(gpu_count)]
        self._base_devices: list[dict[str, Any]] = devices
        self._devices: list[dict[str, Any]] = [dict(d) for d in devices]
        self._ramps: dict[tuple[int, str], tuple[float, float]] = {}
        for idx, keys in (overrides or {}).items():
            if not 0 <= idx < len(self._devices):
                raise RecordingError(f"{source}: overrides: GPU {idx} does not exist ({len(self._devices)} GPUs)")
            for key, val in keys.items():
                self._apply_override(idx, key, val)
        for ev in events:
            if ev.gpu is not None and not 0 <= ev.gpu < len(self._devices):
                raise RecordingError(f"{source}: a '{ev.type}' event at {ev.at:g} s names GPU {ev.gpu}, which does "
                                     f"not exist ({len(self._devices)} GPUs)")
            ramp = ev.data.get("value") if ev.type == "set" else None
            if ev.gpu is not None and isinstance(ramp, Mapping) and "ramp" in ramp:
                self._ramp_base(ev.gpu, str(ev.data.get("key")))  # fails now, not when the event fires
        self._events = sorted(events, key=lambda e: e.at)
        self._next_event = 0
        self._lost: set[int] = set()
        self._slow: dict[int, float] = {}  # GPU index → seconds each call on it waits (``slow`` events)
        self._driver_down_until: float | None = None
        self._initialised = False
        self._xid_queue: list[XidEvent] = []
        self._xid_cond = threading.Condition(self._lock)
        self.kmsg_lines: list[str] = list(kmsg_lines)
        self._t0 = clock()

    # ---------------------------------------------------------------- construction helpers
    @classmethod
    def from_file(cls, path: str | Path, *, clock: Callable[[], float] = time.monotonic) -> FakeNvml:
        """Load a recording (``.json`` with ``devices``) or a scenario (anything with ``recording``)."""
        p = Path(path)
        data = _load_structured(p)
        if not isinstance(data, Mapping):
            raise RecordingError(f"{p}: top level must be an object")
        if "devices" in data:
            return cls(data, source=str(p), clock=clock)
        if "recording" in data:
            return cls.from_scenario(data, base_dir=p.parent, source=str(p), clock=clock)
        raise RecordingError(f"{p}: neither a recording (no 'devices') nor a scenario (no 'recording')")

    @classmethod
    def bundled(cls, name: str = DEFAULT_RECORDING, *, clock: Callable[[], float] = time.monotonic) -> FakeNvml:
        return cls.from_file(bundled_recording_path(name), clock=clock)

    @classmethod
    def from_scenario(
        cls,
        scenario: Mapping[str, Any],
        *,
        base_dir: Path = Path("."),
        source: str = "scenario",
        clock: Callable[[], float] = time.monotonic,
    ) -> FakeNvml:
        """Every part of the scenario is checked here, so a bad one is one ``RecordingError`` naming
        the file and the key — at load, not when a collector first reads the GPU."""
        rec_name = scenario.get("recording")
        if not isinstance(rec_name, str) or not rec_name or "\0" in rec_name:
            raise RecordingError(f"{source}: 'recording' must be a file name")
        rec_path = base_dir / rec_name
        if not rec_path.exists() and rec_name in BUNDLED_RECORDINGS:
            rec_path = bundled_recording_path(rec_name)
        recording = _load_structured(rec_path)
        if not isinstance(recording, Mapping):
            raise RecordingError(f"{rec_path}: top level must be an object")
        overrides: dict[int, Mapping[str, Any]] = {}
        raw_over = scenario.get("overrides") or {}
        if not isinstance(raw_over, Mapping):
            raise RecordingError(f"{source}: 'overrides' must map GPU index → keys")
        for k, v in raw_over.items():
            idx = _index(k, f"{source}: overrides: key {k!r:.40}")
            if not isinstance(v, Mapping):
                raise RecordingError(f"{source}: overrides.{k}: must map recording keys → values")
            for key, val in v.items():
                _check_override(key, val, f"{source}: overrides.{k}.{key}")
            overrides[idx] = v
        raw_events = scenario.get("events") or []
        if not isinstance(raw_events, list) or len(raw_events) > MAX_EVENTS:
            raise RecordingError(f"{source}: 'events' must be a list of at most {MAX_EVENTS} events")
        events = [_event(ev, f"{source}: events[{n}]") for n, ev in enumerate(raw_events)]
        count = scenario.get("gpu_count")
        if count is not None:
            count = _index(count, f"{source}: gpu_count {count!r:.40}")
            if not 1 <= count <= MAX_GPUS:
                raise RecordingError(f"{source}: gpu_count must be 1..{MAX_GPUS}, got {count}")
        raw_system = scenario.get("system") or {}
        if not isinstance(raw_system, Mapping) or not all(
                isinstance(k, str) and k in SYSTEM_KEYS for k in raw_system):
            raise RecordingError(f"{source}: 'system' must map node-wide keys ({', '.join(SYSTEM_KEYS)}) → values")
        if "other_pci_gpus" in raw_system:
            _check_other_pci_gpus(raw_system["other_pci_gpus"], f"{source}: system.other_pci_gpus")
        if raw_system:
            recording = {**recording, **{k: _normalise_override(v, f"{source}: system.{k}")
                                         for k, v in raw_system.items()}}
        kmsg = scenario.get("kmsg") or []
        if not isinstance(kmsg, list) or len(kmsg) > MAX_KMSG_LINES or not all(
                isinstance(x, str) and len(x) <= 16_384 for x in kmsg):
            raise RecordingError(f"{source}: 'kmsg' must be a list of at most {MAX_KMSG_LINES} lines of text")
        return cls(
            recording,
            source=source,
            overrides=overrides,
            events=events,
            gpu_count=count,
            kmsg_lines=kmsg,
            clock=clock,
        )

    @staticmethod
    def _check_recording(rec: Mapping[str, Any], source: str) -> None:
        devices = rec.get("devices")
        if not isinstance(devices, list) or not devices:
            raise RecordingError(f"{source}: 'devices' must be a non-empty list")
        if len(devices) > MAX_GPUS:
            raise RecordingError(f"{source}: {len(devices)} devices, more than {MAX_GPUS}")
        for key in ("driver", "nvml_version", "cuda_driver", "count"):
            if key in rec:
                _check_entry(rec[key], f"{source}: {key}")
        others = rec.get("other_pci_gpus")  # what ``gpuhealth record`` saw on the bus besides NVML's GPUs
        if others is not None:
            if not isinstance(others, Mapping) or "value" not in others:
                raise RecordingError(f"{source}: other_pci_gpus: expected {{'value': [...]}}")
            _check_other_pci_gpus(others["value"], f"{source}: other_pci_gpus")
        for i, d in enumerate(devices):
            if not isinstance(d, Mapping):
                raise RecordingError(f"{source}: devices[{i}] must be an object")
            for key in ("UUID", "PciInfo", "Name"):
                if key not in d:
                    raise RecordingError(f"{source}: devices[{i}]: missing key '{key}'")
            uuid = d["UUID"]
            if not isinstance(uuid, Mapping) or not isinstance(uuid.get("value"), str):
                raise RecordingError(f"{source}: devices[{i}].UUID: expected {{'value': TEXT}}")
            _check_device(d, f"{source}: devices[{i}]")

    @staticmethod
    def _clone(dev: Mapping[str, Any], index: int) -> dict[str, Any]:
        d = copy.deepcopy(dict(dev))
        uuid = str(d["UUID"]["value"])
        d["UUID"] = {"value": f"{uuid[:-4]}{index:04x}"}
        bus = f"00000000:{0x18 + index * 0x10:02X}:00.0"
        for key in ("PciInfo", "PciInfo_v3"):
            if isinstance(d.get(key), Mapping) and isinstance(d[key].get("value"), Mapping):
                v = dict(d[key]["value"])
                v["busId"] = bus
                v["busIdLegacy"] = bus[4:]
                v["bus"] = 0x18 + index * 0x10
                v["device"] = 0
                d[key] = {"value": v}
        if "MinorNumber" in d:
            d["MinorNumber"] = {"value": index}
        if isinstance(d.get("sysfs"), Mapping):
            s = dict(d["sysfs"])
            s["bdf"] = bus[4:].lower()
            d["sysfs"] = s
        return d

    def _apply_override(self, idx: int, key: str, val: Any) -> None:
        dev = self._devices[idx]
        if key == "nvlink":
            links = {str(k): dict(v) for k, v in (dev.get("nvlink") or {}).items()}
            for link, kv in dict(val).items():
                entry = links.setdefault(str(link), {})
                for lk, lv in dict(kv).items():
                    entry[lk] = _normalise_override(lv)
            dev["nvlink"] = links
        elif key == "field_values":
            fv = dict(dev.get("field_values") or {})
            fields = dict(fv.get("fields") or {})
            for name, fval in dict(val).items():
                fields[name] = _normalise_override(fval)
            fv["fields"] = fields
            dev["field_values"] = fv
        elif key == "sysfs":
            s = dict(dev.get("sysfs") or {})
            s.update({k: str(v) for k, v in dict(val).items()})
            dev["sysfs"] = s
        else:
            entry = _normalise_override(val)
            if "ramp" in entry:
                base = self._ramp_base(idx, key)
                self._ramps[(idx, key)] = (float(base), float(entry["ramp"]))
                entry = {"value": base}
            dev[key] = entry

    def _ramp_base(self, idx: int, key: str) -> int | float:
        recorded = self._base_devices[idx].get(key)
        base = recorded.get("value", 0) if isinstance(recorded, Mapping) else 0
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base):
            raise RecordingError(f"{self._source}: a ramp on GPU {idx} {key}: its recorded value "
                                 f"{base!r:.40} is not a number to ramp from")
        return base

    # ---------------------------------------------------------------- time and events
    def elapsed(self) -> float:
        return self._clock() - self._t0

    def _advance(self) -> None:
        now = self.elapsed()
        while self._next_event < len(self._events) and self._events[self._next_event].at <= now:
            ev = self._events[self._next_event]
            self._next_event += 1
            self._fire(ev)
        if self._driver_down_until is not None and now >= self._driver_down_until:
            self._driver_down_until = None

    def _fire(self, ev: _Event) -> None:
        if ev.type == "xid":
            self._xid_queue.append(
                XidEvent(
                    gpu_index=ev.gpu,
                    xid=int(ev.data.get("xid", 0)),
                    timestamp=time.time(),
                    source="nvml",
                    pci_bus_id=self._bus_id(ev.gpu) if ev.gpu is not None else "",
                    detail=str(ev.data.get("detail", "")),
                )
            )
            self._xid_cond.notify_all()
        elif ev.type == "set" and ev.gpu is not None:
            self._apply_override(ev.gpu, str(ev.data["key"]), ev.data.get("value"))
        elif ev.type == "lost" and ev.gpu is not None:
            self._lost.add(ev.gpu)
        elif ev.type == "slow" and ev.gpu is not None:
            self._slow[ev.gpu] = float(ev.data["seconds"])
        elif ev.type == "restore" and ev.gpu is not None:
            self._lost.discard(ev.gpu)
            self._slow.pop(ev.gpu, None)
        elif ev.type == "driver_unloaded":
            until = ev.data.get("until")
            self._driver_down_until = float(until) if until is not None else float("inf")
            self._initialised = False

    def _bus_id(self, idx: int) -> str:
        try:
            return str(self._devices[idx]["PciInfo"]["value"]["busId"])
        except (KeyError, TypeError, IndexError):
            return ""

    def _stall(self, index: int) -> None:
        """A ``slow`` GPU's call waits before it answers, outside the lock: NVML calls on a GPU in
        trouble can take seconds (the reason collectors run under ``collectors.timeout_s``)."""
        with self._lock:
            self._advance()
            delay = self._slow.get(index, 0.0)
        if delay > 0:
            time.sleep(delay)

    def _check(self, index: int | None = None) -> None:
        self._advance()
        if self._driver_down_until is not None:
            raise NvmlError(errors.DRIVER_NOT_LOADED, "Driver Not Loaded")
        if not self._initialised:
            raise NvmlError(errors.UNINITIALIZED, "Uninitialized")
        if index is not None:
            if not 0 <= index < len(self._devices):
                raise NvmlError(errors.INVALID_ARGUMENT, "Invalid Argument")
            if index in self._lost:
                raise NvmlError(errors.GPU_IS_LOST, "GPU is lost")

    # ---------------------------------------------------------------- protocol
    @property
    def simulated(self) -> bool:
        return True

    @property
    def description(self) -> str:
        return f"simulated from {self._source}"

    def init(self) -> None:
        with self._lock:
            self._advance()
            if self._driver_down_until is not None:
                raise NvmlError(errors.DRIVER_NOT_LOADED, "Driver Not Loaded")
            self._initialised = True

    def shutdown(self) -> None:
        with self._lock:
            self._initialised = False

    def system(self, key: str) -> Any:
        with self._lock:
            if key not in HOST_KEYS:  # the recorded host's facts hold while its driver is down, too
                self._check()
            if key not in self._recording:
                raise NvmlError(errors.NOT_SUPPORTED, f"not recorded: {key}")
            return _answer(self._recording[key], f"{self._source}: {key}")

    def device_count(self) -> int:
        with self._lock:
            self._check()
            return len(self._devices)

    def query(self, index: int, key: str) -> Any:
        self._stall(index)
        with self._lock:
            self._check(index)
            entry = self._devices[index].get(key)
            if entry is None:
                raise NvmlError(errors.NOT_SUPPORTED, f"not recorded: {key}")
            if key in ("sysfs", "nvlink", "field_values"):
                return _copy_json(entry)
            value = _answer(entry, f"{self._source}: devices[{index}].{key}")
            ramp = self._ramps.get((index, key))
            if ramp is not None:
                value = int(ramp[0] + ramp[1] * self.elapsed())
            return check_reading(key, value)  # a recording can say anything: BadValue when no GPU could

    def nvlink(self, index: int, link: int, key: str) -> Any:
        self._stall(index)
        with self._lock:
            self._check(index)
            if not 0 <= link < NVLINK_MAX_LINKS:
                raise NvmlError(errors.INVALID_ARGUMENT, "Invalid Argument")
            links = self._devices[index].get("nvlink") or {}
            entry = links.get(str(link))
            if entry is None:
                raise NvmlError(errors.NOT_SUPPORTED, "Not Supported")
            if "error" in entry and key not in entry:  # recorder stored one error for the whole link
                return _answer(entry, f"{self._source}: devices[{index}].nvlink.{link}")
            if key not in entry:
                raise NvmlError(errors.NOT_SUPPORTED, f"not recorded: nvlink.{link}.{key}")
            return check_nvlink(link, key, _answer(entry[key], f"{self._source}: devices[{index}].nvlink.{link}.{key}"))

    def field_values(self, index: int, requests: Sequence[tuple[str, int]]) -> list[FieldResult]:
        self._stall(index)
        with self._lock:
            self._check(index)
            dev = self._devices[index]
            fields = (dev.get("field_values") or {}).get("fields") or {}
            links = dev.get("nvlink") or {}
            out: list[FieldResult] = []
            for name, scope in requests:
                out.append(self._field(fields, links, name, scope))
            return out

    @staticmethod
    def _field(fields: Mapping[str, Any], links: Mapping[str, Any], name: str, scope: int) -> FieldResult:
        # Per-link fields take the link as scope id, link 0 included (the recorder read them with
        # scope 0, so its device-level copy is link 0's value): serve them from the per-link data.
        link_key = _PER_LINK_FIELDS.get(name) if str(scope) in links else None
        link = scope
        if link_key is None:
            for prefix, lk in _NVLINK_ERROR_FIELD_PREFIXES.items():
                if name.startswith(prefix) and name[len(prefix):].isdigit():
                    link_key, link = lk, int(name[len(prefix):])
                    break
        if link_key is not None:
            entry = (links.get(str(link)) or {}).get(link_key)
            if entry is None:
                return NvmlError(errors.NOT_SUPPORTED, "Not Supported")
            if "value" in entry:
                return check_field(name, entry["value"])
            return NvmlError(entry.get("code") or errors.NOT_SUPPORTED, str(entry.get("error", ""))[:200])
        entry = fields.get(name)
        if entry is None:
            return NvmlError(errors.NOT_SUPPORTED, "Not Supported")
        if "value" in entry:
            return check_field(name, entry["value"])
        return NvmlError(entry.get("ret", entry.get("code")) or errors.NOT_SUPPORTED, "field error")

    def wait_xid_events(self, timeout_ms: int) -> list[XidEvent]:
        deadline = time.monotonic() + timeout_ms / 1000
        with self._lock:
            while True:
                self._advance()
                if self._xid_queue:
                    out, self._xid_queue = self._xid_queue, []
                    return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._xid_cond.wait(min(remaining, self._until_next_event()))

    def _until_next_event(self) -> float:
        """How long the XID waiter may sleep: until the next scenario event on the real clock; with an
        injected (test) clock time moves by hand, so poll in small steps."""
        if self._clock is not time.monotonic:
            return 0.05
        if self._next_event >= len(self._events):
            return 3600.0
        return max(0.0, self._events[self._next_event].at - self.elapsed())
