"""Write an "NVML recording v1" of this node: what NVML answers, and how long each call takes.

The format is "NVML recording v1" (docs/architecture.md, Contracts), so ``FakeNvml`` loads the
output as is: per device, per NVML getter, ``{"value": V, "median_us": T}`` or
``{"error": text, "code": nvml_return}`` (``{"error": text}`` without a code when the bindings
themselves failed). A few extra top-level keys say who wrote it and when; readers ignore them.
``anonymize`` replaces serial numbers, UUIDs and the PDI so a recording can be committed. The keys
are the live backend's (``nvml_keys``): what is recorded is what ``RealNvml`` reads.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuhealth import __version__
from gpuhealth.backends.environment import detect_environment
from gpuhealth.backends.errors import BackendUnavailable, NvmlError
from gpuhealth.backends.fabricmanager import fabric_manager_state
from gpuhealth.backends.gpm import read_gpm
from gpuhealth.backends.mig import read_mig_devices
from gpuhealth.backends.nvml_keys import ARGUMENT_KEYS, SIMPLE_KEYS, SLOW_KEYS, nvml_const, resolve_arguments
from gpuhealth.backends.nvml_real import plain
from gpuhealth.backends.sysfs import RealSysfs, normalise_bdf

FORMAT = "NVML recording v1"

SYSFS_FILES = ("numa_node", "local_cpulist", "current_link_speed", "current_link_width", "max_link_speed",
               "max_link_width")
NVLINK_COUNTERS = ("DL_REPLAY", "DL_RECOVERY", "DL_CRC_FLIT", "DL_CRC_DATA", "DL_ECC_DATA")


class Recorder:
    """Records one node through ``pynvml`` (``nvidia-ml-py``)."""

    def __init__(self, nvml: Any, reps: int = 20, sysfs_root: str = "/") -> None:
        self.N = nvml
        self.reps = reps
        self.sysfs_root = Path(sysfs_root)

    def call(self, fn: Callable[..., Any] | None, *args: Any, reps: int | None = None) -> dict[str, Any]:
        """``{"value", "median_us"}`` over ``reps`` calls, or the NVML error with its code."""
        if fn is None:
            return {"error": "absent in bindings"}
        times: list[int] = []
        value: Any = None
        for _ in range(reps or self.reps):
            t0 = time.perf_counter_ns()
            try:
                value = fn(*args)
            except self.N.NVMLError as exc:
                return {"error": str(exc), "code": getattr(exc, "value", None)}
            except Exception as exc:  # wrapper bugs, missing symbols: recorded, not fatal
                return {"error": f"{type(exc).__name__}: {exc}"}
            times.append(time.perf_counter_ns() - t0)
        return {"value": plain(value), "median_us": statistics.median(times) / 1000}

    def record(self) -> dict[str, Any]:
        N = self.N
        t0 = time.perf_counter()
        N.nvmlInit()
        init_s = time.perf_counter() - t0
        try:
            res: dict[str, Any] = {
                "format": FORMAT,
                "recorded_by": f"gpuhealth {__version__}",
                "recorded_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "init_s": init_s,
                "driver": self.call(N.nvmlSystemGetDriverVersion),
                "nvml_version": self.call(N.nvmlSystemGetNVMLVersion),
                "cuda_driver": self.call(N.nvmlSystemGetCudaDriverVersion_v2),
                "count": self.call(N.nvmlDeviceGetCount),
                "devices": [],
            }
            fm = fabric_manager_state(Path(self.sysfs_root) / "proc")
            if fm is not None:  # what a replay reports for this node (backends/fabricmanager.py)
                res["fabric_manager"] = {"value": fm}
            # Bare metal / VM guest / container, NVSwitches seen: a replay is judged as this machine would be.
            res["environment"] = {"value": detect_environment(self.sysfs_root).to_dict()}
            n = N.nvmlDeviceGetCount()
            for i in range(n):
                res["devices"].append(self.device(N.nvmlDeviceGetHandleByIndex(i)))
            res["topology"] = self.topology(n)
            others = self.other_pci_gpus(res["devices"])
            if others:  # a restricted view (container, Slurm job, vfio) replays as one, not as GPUs missing
                res["other_pci_gpus"] = {"value": others}
        finally:
            N.nvmlShutdown()
        return res

    def other_pci_gpus(self, devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """NVIDIA GPUs on this host's PCI bus that NVML did not list, with what this view knows of each
        (the driver it is bound to, its minor in the driver's list, its /dev node): the replay's
        ``system.other_pci_gpus``, so presence tells the same GPUs apart as it did here."""
        listed = set()
        for d in devices:
            info = (d.get("PciInfo") or {}).get("value")
            if isinstance(info, dict) and isinstance(info.get("busId"), str):
                listed.add(normalise_bdf(info["busId"]))
        sysfs = RealSysfs(self.sysfs_root)
        driver_gpus = sysfs.nvidia_driver_gpus() or {}
        out: list[dict[str, Any]] = []
        for dev in sysfs.nvidia_pci_devices():
            bdf = normalise_bdf(dev.bdf)
            if bdf in listed:
                continue
            entry: dict[str, Any] = {"bdf": bdf, "driver": dev.driver}
            minor = driver_gpus.get(bdf)
            if minor is not None:
                node = ("absent" if not sysfs.device_node_exists(minor) else
                        "refused" if sysfs.device_node_refused(minor) else "present")
                entry.update(minor=minor, device_node=node)
            out.append(entry)
        return out

    def device(self, h: Any) -> dict[str, Any]:
        N = self.N
        d: dict[str, Any] = {}
        for key in SIMPLE_KEYS:
            d[key] = self.call(getattr(N, "nvmlDeviceGet" + key, None), h)
        d["GpuFabricInfo"] = self._fabric(h)
        d["GpmMetrics"] = self._gpm(h)
        d["MigDevices"] = self._struct(lambda: read_mig_devices(self.N, h))
        for key, (getter, arguments) in ARGUMENT_KEYS.items():
            args = resolve_arguments(N, arguments)
            fn = getattr(N, "nvmlDeviceGet" + getter, None) if args is not None else None
            d[key] = self.call(fn, h, *(args or ()), reps=2 if key in SLOW_KEYS else None)
        d["nvlink"] = self._nvlinks(h)
        d["field_values"] = self._field_values(h)
        d["event_wait"] = self._event_wait(h)
        d["sysfs"] = self._sysfs(h)
        d["sweep10_median_us"] = self._sweep(h)
        return d

    def _fabric(self, h: Any) -> dict[str, Any]:
        N = self.N
        try:  # the bindings want a ctypes struct passed by reference
            info = N.c_nvmlGpuFabricInfo_t()
            t0 = time.perf_counter_ns()
            N.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
            return {"value": plain(info), "median_us": (time.perf_counter_ns() - t0) / 1000}
        except N.NVMLError as exc:
            return {"error": str(exc), "code": getattr(exc, "value", None)}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _gpm(self, h: Any) -> dict[str, Any]:
        return self._struct(lambda: read_gpm(self.N, h, {}))

    def _struct(self, read: Callable[[], Any]) -> dict[str, Any]:
        """One reading a backends/ helper makes of several NVML calls, as a recording entry."""
        N = self.N
        try:
            t0 = time.perf_counter_ns()
            value = read()
            return {"value": plain(value), "median_us": (time.perf_counter_ns() - t0) / 1000}
        except NvmlError as exc:
            return {"error": exc.message, "code": exc.code}
        except N.NVMLError as exc:
            return {"error": str(exc), "code": getattr(exc, "value", None)}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _nvlinks(self, h: Any) -> dict[str, Any]:
        N = self.N
        links: dict[str, Any] = {}
        for link in range(int(N.NVML_NVLINK_MAX_LINKS)):
            state = self.call(N.nvmlDeviceGetNvLinkState, h, link, reps=3)
            if "error" in state and link > 0:
                links[str(link)] = state
                continue
            entry: dict[str, Any] = {
                "state": state,
                "version": self.call(N.nvmlDeviceGetNvLinkVersion, h, link, reps=3),
                "remote_pci": self.call(N.nvmlDeviceGetNvLinkRemotePciInfo, h, link, reps=3),
                "remote_type": self.call(N.nvmlDeviceGetNvLinkRemoteDeviceType, h, link, reps=3),
            }
            for counter in NVLINK_COUNTERS:
                entry["err_" + counter] = self.call(N.nvmlDeviceGetNvLinkErrorCounter, h, link,
                                                    getattr(N, "NVML_NVLINK_ERROR_" + counter), reps=3)
            links[str(link)] = entry
        return links

    def _field_values(self, h: Any) -> dict[str, Any]:
        N = self.N
        names = {getattr(N, f): f for f in dir(N) if f.startswith("NVML_FI_DEV_") and isinstance(getattr(N, f), int)}
        fids = [getattr(N, f) for f in dir(N) if f.startswith("NVML_FI_DEV_") and isinstance(getattr(N, f), int)]
        fv: dict[str, Any] = {}
        t0 = time.perf_counter_ns()
        try:
            N.nvmlDeviceGetFieldValues(h, fids[:64])
            fv["batch64_us"] = (time.perf_counter_ns() - t0) / 1000
            out: dict[str, Any] = {}
            for fid in fids:
                try:
                    v = N.nvmlDeviceGetFieldValues(h, [fid])[0]
                    if v.nvmlReturn == 0:
                        vt = v.valueType
                        val = {0: v.value.dVal, 1: v.value.uiVal, 2: v.value.ulVal, 3: v.value.ullVal,
                               4: v.value.sllVal, 5: v.value.siVal, 6: getattr(v.value, "usVal", None)}.get(vt)
                        out[names[fid]] = {"value": val, "type": vt}
                    else:
                        out[names[fid]] = {"ret": v.nvmlReturn}
                except Exception as exc:
                    out[names[fid]] = {"error": repr(exc)}
            fv["fields"] = out
        except Exception as exc:
            fv["error"] = repr(exc)
        return fv

    def _event_wait(self, h: Any) -> dict[str, Any]:
        N = self.N
        try:
            es = N.nvmlEventSetCreate()
            N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError | N.nvmlEventTypeDoubleBitEccError
                                       | N.nvmlEventTypeSingleBitEccError, es)
            t0 = time.perf_counter()
            try:
                ev = N.nvmlEventSetWait_v2(es, 200)
                out: dict[str, Any] = {"got": plain(ev)}
            except N.NVMLError as exc:
                out = {"error": str(exc), "waited_s": time.perf_counter() - t0}
            N.nvmlEventSetFree(es)
            return out
        except Exception as exc:
            return {"error": repr(exc)}

    def _sysfs(self, h: Any) -> dict[str, Any]:
        bus = self.N.nvmlDeviceGetPciInfo(h).busId
        bdf = (bus.decode() if isinstance(bus, bytes) else str(bus)).lower()
        if bdf.count(":") == 2 and len(bdf.split(":")[0]) == 8:
            bdf = bdf[4:]
        out: dict[str, Any] = {"bdf": bdf}
        base = self.sysfs_root / "sys" / "bus" / "pci" / "devices" / bdf
        for name in SYSFS_FILES:
            try:
                out[name] = (base / name).read_text().strip()
            except Exception as exc:
                out[name] = "error: " + repr(exc)
        return out

    def _sweep(self, h: Any) -> float | None:
        """Ten rounds of ten cheap getters: what a fast-lane sweep pays per GPU (µs per round).
        None when one of them fails on this GPU (the per-getter entries above say which)."""
        N = self.N
        t0 = time.perf_counter_ns()
        try:
            self._sweep_rounds(h)
        except N.NVMLError:
            return None
        return (time.perf_counter_ns() - t0) / 10000

    def _sweep_rounds(self, h: Any) -> None:
        N = self.N
        for _ in range(10):
            N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU)
            N.nvmlDeviceGetPowerUsage(h)
            N.nvmlDeviceGetUtilizationRates(h)
            N.nvmlDeviceGetMemoryInfo(h)
            N.nvmlDeviceGetCurrentClocksEventReasons(h)
            N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM)
            N.nvmlDeviceGetTotalEccErrors(h, N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, N.NVML_VOLATILE_ECC)
            N.nvmlDeviceGetCurrPcieLinkGeneration(h)
            N.nvmlDeviceGetCurrPcieLinkWidth(h)
            N.nvmlDeviceGetRemappedRows(h)

    def topology(self, n: int) -> dict[str, Any]:
        N = self.N
        out: dict[str, Any] = {}
        if n >= 2:
            a, b = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
            out["common_ancestor_0_1"] = self.call(N.nvmlDeviceGetTopologyCommonAncestor, a, b)
            out["p2p_nvlink_0_1"] = self.call(N.nvmlDeviceGetP2PStatus, a, b, N.NVML_P2P_CAPS_INDEX_NVLINK)
            out["p2p_read_0_1"] = self.call(N.nvmlDeviceGetP2PStatus, a, b, nvml_const(N, "NVML_P2P_CAPS_INDEX_READ"))
        return out


def anonymize(recording: dict[str, Any]) -> dict[str, Any]:
    """Replace identifiers of physical boards (UUID, serial, PDI) with stable fake ones, in place."""
    for i, dev in enumerate(recording.get("devices", [])):
        if isinstance(dev.get("UUID"), dict) and "value" in dev["UUID"]:
            dev["UUID"]["value"] = f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"
        if isinstance(dev.get("Serial"), dict) and "value" in dev["Serial"]:
            dev["Serial"]["value"] = f"{1650000000100 + i}"
        if isinstance(dev.get("Pdi"), dict) and "value" in dev["Pdi"]:
            dev["Pdi"]["value"] = 1000 + i
    recording["anonymized"] = True
    return recording


def load_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise BackendUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from exc
    return pynvml


def record(out: str | Path, *, reps: int = 20, anonymized: bool = False, sysfs_root: str = "/") -> dict[str, Any]:
    """Record this node into ``out``. Raises ``BackendUnavailable`` when there is no NVML driver."""
    N = load_pynvml()
    recorder = Recorder(N, reps=reps, sysfs_root=sysfs_root)
    try:
        data = recorder.record()
    except N.NVMLError as exc:
        raise BackendUnavailable(f"NVIDIA driver not available: {exc}") from exc
    except OSError as exc:
        raise BackendUnavailable(f"cannot load libnvidia-ml: {exc}") from exc
    if anonymized:
        anonymize(data)
    path = Path(out)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=repr))
    tmp.replace(path)
    return data


__all__ = ["FORMAT", "Recorder", "anonymize", "record"]
