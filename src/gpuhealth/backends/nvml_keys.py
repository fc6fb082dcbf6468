"""The NVML getters gpuhealth reads, by "NVML recording v1" key (docs/architecture.md, Contracts).

One list for the live backend (``nvml_real``) and the recorder (``recorder``): what a recording holds
is what the live backend can read, so a collector sees the same keys from both.

- ``SIMPLE_KEYS``: getters of the device handle alone; key = getter name without ``nvmlDeviceGet``.
- ``ARGUMENT_KEYS``: getters that take NVML constants; key = getter name plus argument suffixes
  (``ClockInfo_SM`` = ``nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM)``). An argument is the name
  of a constant of the bindings, or a plain int.
- ``GpuFabricInfo`` fills a struct passed by reference, ``GpmMetrics`` compares two GPM samples
  (``backends/gpm.py``), ``MigDevices`` walks the MIG slots (``backends/mig.py``): each side calls
  them itself.

Bindings differ between nvidia-ml-py versions: a getter or constant a version lacks is "absent in
these bindings" for that key, never an error for the others.
"""

from __future__ import annotations

from typing import Any

SIMPLE_KEYS: tuple[str, ...] = (
    "Name", "UUID", "Serial", "VbiosVersion", "InforomImageVersion", "InforomConfigurationChecksum", "PciInfo",
    "PciInfo_v3", "MinorNumber", "Brand", "Architecture", "CudaComputeCapability", "NumaNodeId", "BoardId",
    "ModuleId", "PersistenceMode", "ComputeMode", "MigMode", "MaxMigDeviceCount", "EccMode", "CurrentEccMode",
    "PerformanceState", "DynamicPstatesInfo", "PowerUsage", "PowerSource", "TotalEnergyConsumption",
    "EnforcedPowerLimit", "PowerManagementLimit", "PowerManagementDefaultLimit", "PowerManagementLimitConstraints",
    "MemoryInfo", "BAR1MemoryInfo", "MemoryBusWidth", "UtilizationRates", "EncoderUtilization",
    "DecoderUtilization", "FanSpeed", "MarginTemperature", "CurrentClocksEventReasons",
    "CurrentClocksThrottleReasons", "SupportedClocksEventReasons", "AdaptiveClockInfoStatus", "ClkMonStatus",
    "CurrPcieLinkGeneration", "CurrPcieLinkWidth", "MaxPcieLinkGeneration", "MaxPcieLinkWidth",
    "GpuMaxPcieLinkGeneration", "PcieLinkMaxSpeed", "PcieSpeed", "PcieReplayCounter", "BusType", "IrqNum",
    "RetiredPagesPendingStatus", "RemappedRows", "RowRemapperHistogram", "UnrepairableMemoryFlag_v1",
    "RepairStatus", "ComputeRunningProcesses", "GraphicsRunningProcesses", "SupportedEventTypes", "NumGpuCores",
    "GspFirmwareMode", "GspFirmwareVersion", "Pdi", "Attributes_v2", "BBXTimeData_v1", "HostVgpuMode",
    "GridLicensableFeatures",
)

Argument = str | int  # a constant of the bindings by name, or a literal


def _argument_keys() -> dict[str, tuple[str, tuple[Argument, ...]]]:
    keys: dict[str, tuple[str, tuple[Argument, ...]]] = {"Temperature_GPU": ("Temperature", ("NVML_TEMPERATURE_GPU",))}
    for name in ("SLOWDOWN", "SHUTDOWN", "GPU_MAX", "MEM_MAX"):
        keys[f"TemperatureThreshold_{name}"] = ("TemperatureThreshold", (f"NVML_TEMPERATURE_THRESHOLD_{name}",))
    for name in ("GRAPHICS", "SM", "MEM", "VIDEO"):
        keys[f"ClockInfo_{name}"] = ("ClockInfo", (f"NVML_CLOCK_{name}",))
        keys[f"MaxClockInfo_{name}"] = ("MaxClockInfo", (f"NVML_CLOCK_{name}",))
    for error_type in ("CORRECTED", "UNCORRECTED"):
        for counter in ("VOLATILE", "AGGREGATE"):
            keys[f"TotalEccErrors_{error_type}_{counter}"] = (
                "TotalEccErrors", (f"NVML_MEMORY_ERROR_TYPE_{error_type}", f"NVML_{counter}_ECC"))
    keys["RetiredPages_SBE"] = ("RetiredPages", ("NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",))
    keys["RetiredPages_DBE"] = ("RetiredPages", ("NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR",))
    for policy in ("POWER", "THERMAL", "SYNC_BOOST", "BOARD_LIMIT", "LOW_UTILIZATION", "RELIABILITY"):
        keys[f"ViolationStatus_{policy}"] = ("ViolationStatus", (f"NVML_PERF_POLICY_{policy}",))
    keys["CpuAffinity_64x4"] = ("CpuAffinity", (4,))  # 4 × 64-bit words: 256 CPUs
    keys["MemoryAffinity_64x4"] = ("MemoryAffinity", (4, "NVML_AFFINITY_SCOPE_NODE"))
    keys["MemoryInfo_v2"] = ("MemoryInfo", ("nvmlMemory_v2",))  # adds "reserved"
    for direction in ("TX", "RX"):
        keys[f"PcieThroughput_{direction}"] = ("PcieThroughput", (f"NVML_PCIE_UTIL_{direction}_BYTES",))
    return keys


ARGUMENT_KEYS: dict[str, tuple[str, tuple[Argument, ...]]] = _argument_keys()
# GpmMetrics: backends/gpm.py; MigDevices: backends/mig.py
STRUCT_KEYS: tuple[str, ...] = ("GpuFabricInfo", "GpmMetrics", "MigDevices")
SLOW_KEYS = frozenset({"PcieThroughput_TX", "PcieThroughput_RX"})  # ~20 ms a call: sampled, never swept
ALL_KEYS: tuple[str, ...] = (*SIMPLE_KEYS, *ARGUMENT_KEYS, *STRUCT_KEYS)


def nvml_const(nvml: Any, name: str) -> Any:
    """A constant of the bindings. nvidia-ml-py 13.x defines ``NVML_P2P_CAPS_INDEX_READ = 0,`` (a
    stray comma makes it the tuple ``(0,)``, which ctypes cannot pass): unwrap one-element tuples."""
    value = getattr(nvml, name)
    if isinstance(value, tuple) and len(value) == 1:
        return value[0]
    return value


def resolve_arguments(nvml: Any, arguments: tuple[Argument, ...]) -> tuple[Any, ...] | None:
    """The argument values these bindings use; None when they lack one of the constants."""
    out: list[Any] = []
    for arg in arguments:
        if isinstance(arg, int):
            out.append(arg)
        elif hasattr(nvml, arg):
            out.append(nvml_const(nvml, arg))
        else:
            return None
    return tuple(out)


__all__ = ["ALL_KEYS", "ARGUMENT_KEYS", "SIMPLE_KEYS", "SLOW_KEYS", "STRUCT_KEYS", "nvml_const", "resolve_arguments"]
