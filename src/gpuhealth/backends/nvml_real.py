"""The real NVML backend (``nvidia-ml-py``, which provides ``import pynvml``).

Keys follow "NVML recording v1": the getter name without ``nvmlDeviceGet`` plus argument suffixes.
Values are converted to plain data the same way the recorder does, so a live reading and a replayed
one look identical to a collector.
"""

from __future__ import annotations

import ctypes
import importlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpuhealth.backends import errors
from gpuhealth.backends.base import FieldResult, XidEvent
from gpuhealth.backends.errors import BackendUnavailable, NvmlError
from gpuhealth.backends.gpm import read_gpm
from gpuhealth.backends.mig import read_mig_devices
from gpuhealth.backends.nvml_keys import ARGUMENT_KEYS, SIMPLE_KEYS, resolve_arguments
from gpuhealth.backends.plausible import check_field, check_nvlink, check_reading


def plain(value: Any, depth: int = 0) -> Any:
    """ctypes structs/arrays, dicts and bytes → dicts/lists/str (the recorder's conversion)."""
    if depth > 5:
        return repr(value)
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, dict):
        # our own readers' answers (GPM metrics, MIG instances): as a repr, the GPM ratios never reached /metrics on
        # real GPUs (2 x H200: gpuhealth_gpu_sm_active_ratio absent while NVML measured it)
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(x, depth + 1) for x in value]
    if isinstance(value, ctypes.Array):
        return [plain(x, depth + 1) for x in value]
    if hasattr(value, "_fields_"):
        return {f[0]: plain(getattr(value, f[0]), depth + 1) for f in value._fields_}
    if type(value).__name__ == "nvmlFriendlyObject":
        # pynvml's process lists (ComputeRunningProcesses…) come back as these plain attribute bags, not
        # ctypes structs; as a repr their pids were unreadable and a screen never saw a job start (2 × H200)
        return {k: plain(v, depth + 1) for k, v in vars(value).items()}
    return repr(value)


# nvmlValueType_t → the member of the nvmlValue_t union that holds the value
_FIELD_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[Any], Any]:
    """A getter of the handle alone, with NVML's extra arguments fixed."""
    return lambda handle: fn(handle, *args)


class RealNvml:
    """Talks to the driver. ``init`` raises ``BackendUnavailable`` when there is no NVML at all."""

    def __init__(self, nvml_module: Any = None) -> None:
        """``nvml_module``: the ``pynvml`` API to call (default: import ``pynvml``). Tests pass a
        stand-in that answers from a real recording — the hardware boundary, replayed."""
        self._module = nvml_module
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self._dispatch: dict[str, Callable[[Any], Any]] = {}
        self._event_set: Any = None
        self._event_lock = threading.Lock()
        # Held while a thread waits in nvmlEventSetWait: shutdown() takes it before freeing the set,
        # so the driver never sees a set freed under a waiter.
        self._event_wait_lock = threading.Lock()
        self._bus_to_index: dict[str, int] = {}
        self._handle_to_index: dict[int, int] = {}
        self._gpm_samples: dict[int, Any] = {}  # GPU handle id → last GPM sample (backends/gpm.py)

    @property
    def simulated(self) -> bool:
        return False

    @property
    def description(self) -> str:
        return "NVML (live)"

    # ------------------------------------------------------------------ lifecycle
    def init(self) -> None:
        pynvml: Any = self._module
        if pynvml is None:
            try:
                pynvml = importlib.import_module("pynvml")
            except ImportError as exc:  # pragma: no cover - dependency is declared
                raise BackendUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            code = getattr(exc, "value", errors.UNKNOWN)
            if code in (errors.LIBRARY_NOT_FOUND, errors.DRIVER_NOT_LOADED):
                raise BackendUnavailable(f"NVIDIA driver not available: {exc}") from exc
            raise NvmlError(code, str(exc)) from exc
        except OSError as exc:
            raise BackendUnavailable(f"cannot load libnvidia-ml: {exc}") from exc
        self._nvml = pynvml
        self._handles.clear()
        self._dispatch = self._build_dispatch(pynvml)
        self._handle_to_index.clear()
        self._bus_to_index.clear()

    def shutdown(self) -> None:
        if self._nvml is None:
            return
        waiter_done = self._event_wait_lock.acquire(timeout=5.0)  # a waiter returns within its timeout
        try:
            with self._event_lock:
                if self._event_set is not None and waiter_done:
                    try:
                        self._nvml.nvmlEventSetFree(self._event_set)
                    except self._nvml.NVMLError:
                        pass
                self._event_set = None  # a set still waited on is leaked rather than freed under the waiter
        finally:
            if waiter_done:
                self._event_wait_lock.release()
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass
        self._nvml = None
        self._handles.clear()

    # ------------------------------------------------------------------ helpers
    def _n(self) -> Any:
        if self._nvml is None:
            raise NvmlError(errors.UNINITIALIZED, "Uninitialized")
        return self._nvml

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        n = self._n()
        try:
            return fn(*args)
        except n.NVMLError as exc:
            raise NvmlError(getattr(exc, "value", errors.UNKNOWN), str(exc)) from exc
        except (TypeError, AttributeError, ctypes.ArgumentError) as exc:
            # nvidia-ml-py versions differ in signatures and constants (seen: GpuFabricInfo taking a
            # struct, NVML_P2P_CAPS_INDEX_READ a tuple): for the caller this getter is unavailable here.
            raise NvmlError(errors.FUNCTION_NOT_FOUND, f"these NVML bindings cannot make this call: {exc}") from exc

    def _handle(self, index: int) -> Any:
        h = self._handles.get(index)
        if h is None:
            n = self._n()
            h = self._call(n.nvmlDeviceGetHandleByIndex, index)
            self._handles[index] = h
        return h

    def _build_dispatch(self, n: Any) -> dict[str, Callable[[Any], Any]]:
        d: dict[str, Callable[[Any], Any]] = {}
        for key in SIMPLE_KEYS:
            fn = getattr(n, "nvmlDeviceGet" + key, None)
            if fn is not None:
                d[key] = fn
        for key, (getter, arguments) in ARGUMENT_KEYS.items():
            fn = getattr(n, "nvmlDeviceGet" + getter, None)
            args = resolve_arguments(n, arguments)
            if fn is not None and args is not None:  # else: absent in these bindings (FUNCTION_NOT_FOUND)
                d[key] = _bind(fn, *args)

        def fabric(h: Any) -> Any:
            info = n.c_nvmlGpuFabricInfo_t()
            n.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
            return info

        d["GpuFabricInfo"] = fabric
        self._gpm_samples = {}  # samples of a previous init are void
        d["GpmMetrics"] = lambda h: read_gpm(n, h, self._gpm_samples)
        d["MigDevices"] = lambda h: read_mig_devices(n, h)
        return d

    # ------------------------------------------------------------------ protocol
    def system(self, key: str) -> Any:
        n = self._n()
        fn = {
            "driver": n.nvmlSystemGetDriverVersion,
            "nvml_version": n.nvmlSystemGetNVMLVersion,
            "cuda_driver": n.nvmlSystemGetCudaDriverVersion_v2,
        }.get(key)
        if fn is None:
            raise NvmlError(errors.NOT_SUPPORTED, f"unknown system key {key}")
        return plain(self._call(fn))

    def device_count(self) -> int:
        n = self._n()
        return int(self._call(n.nvmlDeviceGetCount))

    def query(self, index: int, key: str) -> Any:
        fn = self._dispatch.get(key)
        if fn is None:
            self._n()
            raise NvmlError(errors.FUNCTION_NOT_FOUND, f"no getter for {key} in these bindings")
        return check_reading(key, plain(self._call(fn, self._handle(index))))  # a driver can return garbage too

    def nvlink(self, index: int, link: int, key: str) -> Any:
        return check_nvlink(link, key, self._nvlink(index, link, key))

    def _nvlink(self, index: int, link: int, key: str) -> Any:
        n = self._n()
        h = self._handle(index)
        if key == "state":
            return plain(self._call(n.nvmlDeviceGetNvLinkState, h, link))
        if key == "version":
            return plain(self._call(n.nvmlDeviceGetNvLinkVersion, h, link))
        if key == "remote_pci":
            return plain(self._call(n.nvmlDeviceGetNvLinkRemotePciInfo, h, link))
        if key == "remote_type":
            return plain(self._call(n.nvmlDeviceGetNvLinkRemoteDeviceType, h, link))
        if key.startswith("err_"):
            const = getattr(n, "NVML_NVLINK_ERROR_" + key[4:], None)
            if const is None:
                raise NvmlError(errors.INVALID_ARGUMENT, f"unknown nvlink counter {key}")
            return plain(self._call(n.nvmlDeviceGetNvLinkErrorCounter, h, link, const))
        raise NvmlError(errors.INVALID_ARGUMENT, f"unknown nvlink key {key}")

    def field_values(self, index: int, requests: Sequence[tuple[str, int]]) -> list[FieldResult]:
        n = self._n()
        ids: list[tuple[int, int]] = []
        out: list[FieldResult] = [None] * len(requests)
        positions: list[int] = []
        for pos, (name, scope) in enumerate(requests):
            fid = getattr(n, name, None)
            if not isinstance(fid, int):
                out[pos] = NvmlError(errors.NOT_SUPPORTED, f"{name} unknown to these bindings")
                continue
            ids.append((fid, scope))
            positions.append(pos)
        if not ids:
            return out
        values = self._call(n.nvmlDeviceGetFieldValues, self._handle(index), ids)
        for pos, v in zip(positions, values, strict=True):
            if v.nvmlReturn != 0:
                out[pos] = NvmlError(int(v.nvmlReturn), "field error")
                continue
            member = _FIELD_VALUE_MEMBER.get(v.valueType)
            value = getattr(v.value, member, None) if member else None
            out[pos] = None if value is None else check_field(requests[pos][0], value)
        return out

    def _ensure_event_set(self) -> Any:
        n = self._n()
        if self._event_set is not None:
            return self._event_set
        es = self._call(n.nvmlEventSetCreate)
        count = self.device_count()
        for i in range(count):
            try:
                h = self._handle(i)
                self._call(n.nvmlDeviceRegisterEvents, h, n.nvmlEventTypeXidCriticalError, es)
                self._handle_to_index[ctypes.cast(h, ctypes.c_void_p).value or 0] = i
            except NvmlError:
                continue  # a GPU that cannot register events still gets kernel-log XIDs
        self._event_set = es
        return es

    def wait_xid_events(self, timeout_ms: int) -> list[XidEvent]:
        n = self._n()
        with self._event_wait_lock:
            with self._event_lock:
                es = self._ensure_event_set()
            try:
                data = n.nvmlEventSetWait_v2(es, timeout_ms)
            except n.NVMLError as exc:
                if getattr(exc, "value", None) == errors.TIMEOUT:
                    return []
                raise NvmlError(getattr(exc, "value", errors.UNKNOWN), str(exc)) from exc
        handle_key = ctypes.cast(data.device, ctypes.c_void_p).value or 0
        idx = self._handle_to_index.get(handle_key)
        return [XidEvent(gpu_index=idx, xid=int(data.eventData), timestamp=time.time(), source="nvml")]
