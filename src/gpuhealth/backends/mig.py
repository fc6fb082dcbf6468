"""MIG instances of one GPU (recording key ``MigDevices``): what the kubelet and Slurm call the
devices a job holds when the GPU is partitioned. Each answers with its own ``MIG-…`` UUID; the
parent GPU is the one whose handle enumerated it.

NVML: ``nvmlDeviceGetMigDeviceHandleByIndex`` for 0 … ``MaxMigDeviceCount``-1 (NOT_FOUND where a slot
is empty), then the MIG handle's UUID, name (``… MIG 1g.10gb``), GPU/compute instance ids and
memory. A GPU with MIG off answers an empty list.
"""

from __future__ import annotations

from typing import Any

from gpuhealth.backends import errors
from gpuhealth.backends.errors import NvmlError

NOT_FOUND = 6  # NVML_ERROR_NOT_FOUND: no MIG device in this slot


def read_mig_devices(n: Any, handle: Any) -> list[dict[str, Any]]:
    """The MIG devices of the GPU at ``handle``, as plain data. Raises ``NvmlError(NOT_SUPPORTED)``
    when the GPU (or these bindings) have no MIG."""
    if not hasattr(n, "nvmlDeviceGetMigDeviceHandleByIndex"):
        raise NvmlError(errors.FUNCTION_NOT_FOUND, "these NVML bindings have no MIG calls")
    current, _pending = n.nvmlDeviceGetMigMode(handle)
    if not current:
        return []
    out: list[dict[str, Any]] = []
    for slot in range(int(n.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = n.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except n.NVMLError as exc:
            if getattr(exc, "value", None) == NOT_FOUND:
                continue
            raise
        uuid = n.nvmlDeviceGetUUID(mig)
        entry: dict[str, Any] = {"slot": slot, "uuid": uuid.decode() if isinstance(uuid, bytes) else str(uuid)}
        for key, call in (("name", "nvmlDeviceGetName"), ("gpu_instance_id", "nvmlDeviceGetGpuInstanceId"),
                          ("compute_instance_id", "nvmlDeviceGetComputeInstanceId")):
            try:
                value = getattr(n, call)(mig)
            except n.NVMLError:
                continue  # one unreadable attribute does not hide the instance
            entry[key] = value.decode() if isinstance(value, bytes) else value
        try:
            entry["memory_total"] = int(n.nvmlDeviceGetMemoryInfo(mig).total)
        except n.NVMLError:
            pass
        out.append(entry)
    return out


__all__ = ["read_mig_devices"]
