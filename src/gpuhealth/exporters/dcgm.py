"""``--dcgm-compat``: the same readings again under dcgm-exporter's names, units and labels, so the
standard dcgm-exporter Grafana dashboard (grafana.com 12239) and alerts written for it keep working.

Two schemas, picked by ``agent.dcgm_schema``:

- ``4.10`` (the default): dcgm-exporter 4.9/4.10, whose default counters carry DCGM's renamed fields
  (DCGM Field Naming Standard: unit and ``_RATIO``/``_TOTAL`` in the name; clocks in Hz, energy in J,
  utilization as a 0-1 ratio, framebuffer in bytes), ``DCGM_FI_PROF_*_BYTES_PER_SECOND`` and the driver
  label ``DCGM_FI_SYSTEM_DRIVER_VERSION``.
- ``4.8``: dcgm-exporter 4.5-4.8 (``etc/default-counters.csv`` of 4.8.2): the old names and units
  (MHz, mJ, %, MiB) and ``DCGM_FI_DRIVER_VERSION``, which existing dashboards and alert rules select on.
- ``both``: the two at once while dashboards and rules migrate (every series carries both driver labels).

Where each 4.10 name comes from (the DCGM header's deprecation table, go-dcgm, or only the issue that asked
for it) is said per row in ``tests/fixtures/dcgm_exporter/schema-4.10.csv``. The node label is ``Hostname``
for 4.8 (as 4.5.0-4.8.2 write it) and ``hostname`` for 4.10 (4.8.3 and later); ``agent.dcgm_hostname_label``
overrides. The Slurm job a GPU runs is ``hpc_job``, as dcgm-exporter's HPC job mapping names it.

Counters keep dcgm-exporter's names without ``_total`` and are typed ``counter`` in the text format, as
dcgm-exporter writes them; OpenMetrics, which requires ``_total`` on a counter, gets them as ``unknown``.
The mapping tables in ``docs/metrics.md`` are generated from ``FIELDS``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gpuhealth.collectors.xid import xid_message
from gpuhealth.exporters import ExportSnapshot
from gpuhealth.exporters.families import Family, FamilySet, Labels, gpu_holder_labels

MIB = float(1 << 20)
NS_PER_S = 1e9
OLD, NEW = "4.8", "4.10"
SCHEMAS = (NEW, OLD)  # served alone; "both" serves the two
SCHEMA_CHOICES = (NEW, OLD, "both")
DEFAULT_SCHEMA = NEW
BOTH = (OLD, NEW)
# The driver version is a label of every series; DCGM 4.6 renamed the field it comes from.
DRIVER_LABEL = {OLD: "DCGM_FI_DRIVER_VERSION", NEW: "DCGM_FI_SYSTEM_DRIVER_VERSION"}
# dcgm-exporter 4.5.0-4.8.2 name the node "Hostname", 4.8.3 and later "hostname" (its commit d5e5f51, #655).
HOSTNAME_LABELS = ("Hostname", "hostname")
AUTO_HOSTNAME = "auto"
SCHEMA_HOSTNAME = {OLD: "Hostname", NEW: "hostname", "both": "hostname"}
DEFAULT_HOSTNAME_LABEL = SCHEMA_HOSTNAME[DEFAULT_SCHEMA]
# dcgm-exporter's HPC job mapping names the job holding a GPU "hpc_job"; our label provider says slurm_job_id.
JOB_LABELS = {"slurm_job_id": "hpc_job"}
DCGM_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", *HOSTNAME_LABELS, *DRIVER_LABEL.values())

# NVML clock-event reason bits (nvml.h nvmlClocksEventReason*), keyed by the throttle collector's
# ``reason`` label; DCGM_FI_DEV_CLOCKS_EVENT_REASONS is this bitmask.
CLOCK_EVENT_BITS: dict[str, int] = {
    "gpu_idle": 0x1, "applications_clocks": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8, "sync_boost": 0x10,
    "sw_thermal": 0x20, "hw_thermal": 0x40, "hw_power_brake": 0x80, "display_clocks": 0x100,
}


@dataclass(frozen=True, slots=True)
class DcgmField:
    """One dcgm-exporter series computed from one of our samples, in the schemas that name it so."""

    name: str  # dcgm-exporter's metric name
    type: str  # dcgm-exporter's declared type (counter/gauge)
    help: str  # dcgm-exporter's help text
    source: str  # our sample name (without the gpuhealth_ prefix)
    match: tuple[tuple[str, str], ...] = ()  # our sample's labels that select it
    scale: float = 1.0  # ours × scale = dcgm's unit
    keep_labels: tuple[str, ...] = ()  # our labels carried over (e.g. xid)
    sum_over: str | None = None  # label summed away (NVLink links → _TOTAL)
    unit: str = ""  # dcgm-exporter's unit, for docs/metrics.md
    note: str = ""  # what else a reader must know, for docs/metrics.md
    schemas: tuple[str, ...] = BOTH  # the dcgm-exporter releases that name the field so
    old_name: str = ""  # a 4.10 field: its 4.8 name, for docs/metrics.md


def _old(*args: Any, **kw: Any) -> DcgmField:
    """A field only dcgm-exporter 4.5-4.8 name so."""
    return replace(DcgmField(*args, **kw), schemas=(OLD,))


def _new(old_name: str, *args: Any, **kw: Any) -> DcgmField:
    """A field as 4.9/4.10 name it, in place of ``old_name``."""
    return replace(DcgmField(*args, **kw), schemas=(NEW,), old_name=old_name)


_TEMP_GPU = (("sensor", "gpu"),)
_TEMP_MEM = (("sensor", "memory"),)
_CORR_VOL = (("type", "corrected"), ("scope", "volatile"))
_UNC_VOL = (("type", "uncorrected"), ("scope", "volatile"))
_CORR_AGG = (("type", "corrected"), ("scope", "aggregate"))
_UNC_AGG = (("type", "uncorrected"), ("scope", "aggregate"))
_XID_NOTE = "value of the last active XID, 0 when none; labels `err_code`, `err_msg`"
_PRE_AMPERE = "GPUs before Ampere only"
_PCIE_TX_HELP = ("The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads "
                 "- in bytes per second.")
_PCIE_RX_HELP = ("The rate of data received over the PCIe bus - including both protocol headers and data payloads "
                 "- in bytes per second.")

FIELDS: tuple[DcgmField, ...] = (
    # --- clocks, temperatures, power, energy
    _old("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", "gpu_clock_hertz",
         (("clock", "sm"),), 1e-6, unit="MHz"),
    _new("DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_SM_CLOCK_HERTZ", "gauge", "SM clock frequency (in Hz).",
         "gpu_clock_hertz", (("clock", "sm"),), unit="Hz"),
    _old("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", "gpu_clock_hertz",
         (("clock", "memory"),), 1e-6, unit="MHz"),
    _new("DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_CLOCK_HERTZ", "gauge", "Memory clock frequency (in Hz).",
         "gpu_clock_hertz", (("clock", "memory"),), unit="Hz"),
    _old("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", "gpu_temperature_celsius", _TEMP_MEM,
         unit="°C"),
    _new("DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_MEMORY_TEMP_CELSIUS", "gauge", "Memory temperature (in C).",
         "gpu_temperature_celsius", _TEMP_MEM, unit="°C"),
    _old("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", "gpu_temperature_celsius", _TEMP_GPU, unit="°C"),
    _new("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_TEMP_CELSIUS", "gauge", "GPU temperature (in C).",
         "gpu_temperature_celsius", _TEMP_GPU, unit="°C"),
    _old("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", "gpu_power_watts", unit="W"),
    _new("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_BOARD_POWER_WATTS", "gauge", "Power draw (in W).",
         "gpu_power_watts", unit="W"),
    _old("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "Power management limit (in W).", "gpu_power_limit_watts",
         unit="W"),
    _new("DCGM_FI_DEV_POWER_MGMT_LIMIT", "DCGM_FI_DEV_BOARD_POWER_LIMIT_REQUESTED_WATTS", "gauge",
         "Power management limit (in W).", "gpu_power_limit_watts", unit="W"),
    _old("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ).",
         "gpu_energy_joules", scale=1e3, unit="mJ"),
    _new("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", "counter",
         "Total energy consumption since boot (in J).", "gpu_energy_joules", unit="J"),
    # --- PCIe
    _old("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.", "gpu_pcie_replay",
         unit="replays"),
    _new("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_PCIE_REPLAY_TOTAL", "counter",
         "Total number of PCIe retries.", "gpu_pcie_replay", unit="replays"),
    DcgmField("DCGM_FI_DEV_PCIE_LINK_GEN", "gauge", "PCIe current link generation.", "gpu_pcie_link_generation",
              (("which", "current"),), unit="generation"),
    DcgmField("DCGM_FI_DEV_PCIE_LINK_WIDTH", "gauge", "PCIe current link width.", "gpu_pcie_link_width",
              (("which", "current"),), unit="lanes"),
    # --- utilization
    _old("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", "gpu_utilization_ratio", scale=100.0, unit="%"),
    _new("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_UTIL_RATIO", "gauge", "GPU utilization (ratio, 0-1).",
         "gpu_utilization_ratio", unit="ratio"),
    _old("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", "gpu_memory_utilization_ratio",
         scale=100.0, unit="%"),
    _new("DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_MEMORY_COPY_UTIL_RATIO", "gauge",
         "Memory utilization (ratio, 0-1).", "gpu_memory_utilization_ratio", unit="ratio"),
    _old("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", "gpu_encoder_utilization_ratio",
         scale=100.0, unit="%"),
    _new("DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_ENC_UTIL_RATIO", "gauge", "Encoder utilization (ratio, 0-1).",
         "gpu_encoder_utilization_ratio", unit="ratio"),
    _old("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", "gpu_decoder_utilization_ratio",
         scale=100.0, unit="%"),
    _new("DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_DEC_UTIL_RATIO", "gauge", "Decoder utilization (ratio, 0-1).",
         "gpu_decoder_utilization_ratio", unit="ratio"),
    # --- XID
    _old("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", "gpu_xid_last",
         unit="XID code", note=_XID_NOTE),
    _new("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR", "gauge", "Value of the last XID error encountered.",
         "gpu_xid_last", unit="XID code", note=_XID_NOTE),
    # --- framebuffer
    _old("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", "gpu_memory_free_bytes",
         scale=1 / MIB, unit="MiB"),
    _new("DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_FREE_BYTES", "gauge", "Framebuffer memory free (in bytes).",
         "gpu_memory_free_bytes", unit="bytes"),
    _old("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", "gpu_memory_used_bytes",
         scale=1 / MIB, unit="MiB"),
    _new("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_USED_BYTES", "gauge", "Framebuffer memory used (in bytes).",
         "gpu_memory_used_bytes", unit="bytes"),
    _old("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).", "gpu_memory_reserved_bytes",
         scale=1 / MIB, unit="MiB"),
    _new("DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_DEV_FB_RESERVED_BYTES", "gauge",
         "Framebuffer memory reserved (in bytes).", "gpu_memory_reserved_bytes", unit="bytes"),
    _old("DCGM_FI_DEV_FB_TOTAL", "gauge", "Framebuffer memory total (in MiB).", "gpu_memory_total_bytes",
         scale=1 / MIB, unit="MiB"),
    _new("DCGM_FI_DEV_FB_TOTAL", "DCGM_FI_DEV_FB_CAPACITY_BYTES", "gauge", "Framebuffer memory capacity (in bytes).",
         "gpu_memory_total_bytes", unit="bytes"),
    # --- ECC, retired pages, row remapping
    DcgmField("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors.",
              "gpu_ecc_errors", _CORR_VOL, unit="errors"),
    DcgmField("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors.",
              "gpu_ecc_errors", _UNC_VOL, unit="errors"),
    DcgmField("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter", "Total number of single-bit persistent ECC errors.",
              "gpu_ecc_errors", _CORR_AGG, unit="errors"),
    DcgmField("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter", "Total number of double-bit persistent ECC errors.",
              "gpu_ecc_errors", _UNC_AGG, unit="errors"),
    _old("DCGM_FI_DEV_RETIRED_SBE", "counter", "Total number of retired pages due to single-bit errors.",
         "gpu_retired_pages", (("cause", "sbe"),), unit="pages", note=_PRE_AMPERE),
    _new("DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_PAGE_RETIRED_SBE_TOTAL", "counter",
         "Total number of retired pages due to single-bit errors.", "gpu_retired_pages", (("cause", "sbe"),),
         unit="pages", note=_PRE_AMPERE),
    _old("DCGM_FI_DEV_RETIRED_DBE", "counter", "Total number of retired pages due to double-bit errors.",
         "gpu_retired_pages", (("cause", "dbe"),), unit="pages", note=_PRE_AMPERE),
    _new("DCGM_FI_DEV_RETIRED_DBE", "DCGM_FI_DEV_PAGE_RETIRED_DBE_TOTAL", "counter",
         "Total number of retired pages due to double-bit errors.", "gpu_retired_pages", (("cause", "dbe"),),
         unit="pages", note=_PRE_AMPERE),
    _old("DCGM_FI_DEV_RETIRED_PENDING", "counter", "Total number of pages pending retirement.",
         "gpu_retired_pages_pending", unit="0/1", note=_PRE_AMPERE),
    _new("DCGM_FI_DEV_RETIRED_PENDING", "DCGM_FI_DEV_PAGE_RETIRED_PENDING", "gauge",
         "Whether pages are pending retirement.", "gpu_retired_pages_pending", unit="0/1", note=_PRE_AMPERE),
    _old("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for uncorrectable errors",
         "gpu_remapped_rows", (("cause", "uncorrectable"),), unit="rows"),
    _new("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_UNCORRECTABLE_TOTAL", "counter",
         "Number of remapped rows for uncorrectable errors", "gpu_remapped_rows", (("cause", "uncorrectable"),),
         unit="rows"),
    _old("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors",
         "gpu_remapped_rows", (("cause", "correctable"),), unit="rows"),
    _new("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_CORRECTABLE_TOTAL", "counter",
         "Number of remapped rows for correctable errors", "gpu_remapped_rows", (("cause", "correctable"),),
         unit="rows"),
    _old("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed", "gpu_row_remap_failed",
         unit="0/1"),
    _new("DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_ROW_REMAP_FAILED", "gauge",
         "Whether remapping of rows has failed", "gpu_row_remap_failed", unit="0/1"),
    DcgmField("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Whether remapping of rows is pending",
              "gpu_row_remap_pending", unit="0/1"),
    # --- throttling (violation counters: NVML counts ns)
    DcgmField("DCGM_FI_DEV_POWER_VIOLATION", "counter", "Throttling duration due to power constraints (in ns).",
              "gpu_throttle_violation_seconds", (("reason", "power"),), NS_PER_S, unit="ns"),
    DcgmField("DCGM_FI_DEV_THERMAL_VIOLATION", "counter",
              "Throttling duration due to thermal constraints (in ns).", "gpu_throttle_violation_seconds",
              (("reason", "thermal"),), NS_PER_S, unit="ns"),
    DcgmField("DCGM_FI_DEV_SYNC_BOOST_VIOLATION", "counter",
              "Throttling duration due to sync-boost constraints (in ns).", "gpu_throttle_violation_seconds",
              (("reason", "sync_boost"),), NS_PER_S, unit="ns"),
    DcgmField("DCGM_FI_DEV_BOARD_LIMIT_VIOLATION", "counter",
              "Throttling duration due to board limit constraints (in ns).", "gpu_throttle_violation_seconds",
              (("reason", "board_limit"),), NS_PER_S, unit="ns"),
    DcgmField("DCGM_FI_DEV_LOW_UTIL_VIOLATION", "counter", "Throttling duration due to low utilization (in ns).",
              "gpu_throttle_violation_seconds", (("reason", "low_utilization"),), NS_PER_S, unit="ns"),
    DcgmField("DCGM_FI_DEV_RELIABILITY_VIOLATION", "counter",
              "Throttling duration due to reliability constraints (in ns).", "gpu_throttle_violation_seconds",
              (("reason", "reliability"),), NS_PER_S, unit="ns"),
    # --- NVLink
    _old("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink flow-control CRC errors.",
         "gpu_nvlink_errors", (("counter", "crc"),), sum_over="link", unit="errors"),
    _new("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_TOTAL", "counter",
         "Total number of NVLink flow-control CRC errors.", "gpu_nvlink_errors", (("counter", "crc"),),
         sum_over="link", unit="errors"),
    _old("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink retries.",
         "gpu_nvlink_errors", (("counter", "replay"),), sum_over="link", unit="errors"),
    _new("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_TOTAL", "counter",
         "Total number of NVLink retries.", "gpu_nvlink_errors", (("counter", "replay"),), sum_over="link",
         unit="errors"),
    _old("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink recovery errors.",
         "gpu_nvlink_errors", (("counter", "recovery"),), sum_over="link", unit="errors"),
    _new("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_TOTAL", "counter",
         "Total number of NVLink recovery errors.", "gpu_nvlink_errors", (("counter", "recovery"),),
         sum_over="link", unit="errors"),
    # DCGM sums NVML's cumulative NVLINK_THROUGHPUT_DATA_{TX,RX} counters as NVML gives them, in KiB
    # (DCGM DcgmCacheManager::ReadAndCacheNvLinkBandwidth)
    _old("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter", "Total number of NVLink bandwidth counters for all lanes.",
         "gpu_nvlink_traffic_bytes", scale=1 / 1024, sum_over="direction", unit="KiB",
         note="NVML's cumulative NVLink data counters, both directions"),
    _new("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_NVLINK_THROUGHPUT_TOTAL", "gauge",
         "NVLink throughput of all links, both directions (in bytes per second).",
         "gpu_nvlink_throughput_bytes_per_second", sum_over="direction", unit="bytes/s",
         note="NVML GPM NVLINK_TOTAL_TX_PER_SEC + NVLINK_TOTAL_RX_PER_SEC"),
    # --- vGPU licensing (NVML nvmlDeviceGetGridLicensableFeatures, as DCGM reads it for a GPU)
    DcgmField("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status", "gpu_vgpu_licensed", unit="0/1",
              note="0 also where the GPU has no vGPU licensing, as DCGM reports it"),
    # --- profiling: DCGM's profiling module, or NVML's GPM (Hopper and later) without DCGM
    _old("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.",
         "gpu_graphics_active_ratio", unit="ratio", note="NVML GPM GRAPHICS_UTIL"),
    _new("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", "gauge",
         "Ratio of time the graphics engine is active.", "gpu_graphics_active_ratio", unit="ratio",
         note="NVML GPM GRAPHICS_UTIL"),
    _old("DCGM_FI_PROF_SM_ACTIVE", "gauge", "The ratio of cycles an SM has at least 1 warp assigned.",
         "gpu_sm_active_ratio", unit="ratio", note="NVML GPM SM_UTIL"),
    _new("DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_UTIL_RATIO", "gauge",
         "The ratio of cycles an SM has at least 1 warp assigned.", "gpu_sm_active_ratio", unit="ratio",
         note="NVML GPM SM_UTIL"),
    _old("DCGM_FI_PROF_SM_OCCUPANCY", "gauge", "The ratio of number of warps resident on an SM.",
         "gpu_sm_occupancy_ratio", unit="ratio", note="NVML GPM SM_OCCUPANCY"),
    _new("DCGM_FI_PROF_SM_OCCUPANCY", "DCGM_FI_PROF_SM_OCCUPANCY_RATIO", "gauge",
         "The ratio of number of warps resident on an SM.", "gpu_sm_occupancy_ratio", unit="ratio",
         note="NVML GPM SM_OCCUPANCY"),
    _old("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active.",
         "gpu_tensor_active_ratio", unit="ratio", note="NVML GPM ANY_TENSOR_UTIL"),
    _new("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_TENSOR_UTIL_RATIO", "gauge",
         "Ratio of cycles the tensor (HMMA) pipe is active.", "gpu_tensor_active_ratio", unit="ratio",
         note="NVML GPM ANY_TENSOR_UTIL"),
    _old("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
         "Ratio of cycles the device memory interface is active sending or receiving data.",
         "gpu_dram_active_ratio", unit="ratio", note="NVML GPM DRAM_BW_UTIL"),
    _new("DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_DRAM_UTIL_RATIO", "gauge",
         "Ratio of cycles the device memory interface is active sending or receiving data.",
         "gpu_dram_active_ratio", unit="ratio", note="NVML GPM DRAM_BW_UTIL"),
    _old("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", _PCIE_TX_HELP, "gpu_pcie_throughput_bytes_per_second",
         (("direction", "tx"),), unit="bytes/s", note="NVML GPM PCIE_TX_PER_SEC"),
    _new("DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND", "gauge", _PCIE_TX_HELP,
         "gpu_pcie_throughput_bytes_per_second", (("direction", "tx"),), unit="bytes/s",
         note="NVML GPM PCIE_TX_PER_SEC"),
    _old("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", _PCIE_RX_HELP, "gpu_pcie_throughput_bytes_per_second",
         (("direction", "rx"),), unit="bytes/s", note="NVML GPM PCIE_RX_PER_SEC"),
    _new("DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES_PER_SECOND", "gauge", _PCIE_RX_HELP,
         "gpu_pcie_throughput_bytes_per_second", (("direction", "rx"),), unit="bytes/s",
         note="NVML GPM PCIE_RX_PER_SEC"),
    _old("DCGM_FI_PROF_NVLINK_TX_BYTES", "gauge", "The rate of data transmitted over NVLink, in bytes per second.",
         "gpu_nvlink_throughput_bytes_per_second", (("direction", "tx"),), unit="bytes/s",
         note="NVML GPM NVLINK_TOTAL_TX_PER_SEC"),
    _new("DCGM_FI_PROF_NVLINK_TX_BYTES", "DCGM_FI_PROF_NVLINK_TX_BYTES_PER_SECOND", "gauge",
         "The rate of data transmitted over NVLink, in bytes per second.", "gpu_nvlink_throughput_bytes_per_second",
         (("direction", "tx"),), unit="bytes/s", note="NVML GPM NVLINK_TOTAL_TX_PER_SEC"),
    _old("DCGM_FI_PROF_NVLINK_RX_BYTES", "gauge", "The rate of data received over NVLink, in bytes per second.",
         "gpu_nvlink_throughput_bytes_per_second", (("direction", "rx"),), unit="bytes/s",
         note="NVML GPM NVLINK_TOTAL_RX_PER_SEC"),
    _new("DCGM_FI_PROF_NVLINK_RX_BYTES", "DCGM_FI_PROF_NVLINK_RX_BYTES_PER_SECOND", "gauge",
         "The rate of data received over NVLink, in bytes per second.", "gpu_nvlink_throughput_bytes_per_second",
         (("direction", "rx"),), unit="bytes/s", note="NVML GPM NVLINK_TOTAL_RX_PER_SEC"),
)

# The throttle reasons as one bitmask: today's name in both schemas, the older one dashboards still use in 4.8.
CLOCK_REASON_FAMILIES = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
CLOCK_REASON_SCHEMAS: dict[str, tuple[str, ...]] = {CLOCK_REASON_FAMILIES[0]: BOTH, CLOCK_REASON_FAMILIES[1]: (OLD,)}
_CLOCK_REASONS_HELP = "Current clock event (throttle) reasons, NVML bitmask."


def schema_releases(schema: str) -> tuple[str, ...]:
    """The releases a ``agent.dcgm_schema`` value serves."""
    if schema == "both":
        return BOTH
    if schema not in SCHEMAS:
        raise ValueError(f"dcgm schema {schema!r} is not one of {', '.join(SCHEMA_CHOICES)}")
    return (schema,)


def fields_of(schema: str) -> tuple[DcgmField, ...]:
    """The fields ``schema`` serves, each once (a field both releases name alike is one family)."""
    releases = set(schema_releases(schema))
    return tuple(f for f in FIELDS if releases & set(f.schemas))


def hostname_label_of(schema: str, hostname_label: str = AUTO_HOSTNAME) -> str:
    """The node label's name: as asked, or (``auto``) as the schema's dcgm-exporter release writes it."""
    return SCHEMA_HOSTNAME[schema] if hostname_label == AUTO_HOSTNAME else hostname_label


def dcgm_label_sets(snap: ExportSnapshot, hostname_label: str, schema: str = DEFAULT_SCHEMA) -> dict[int, Labels]:
    extra = gpu_holder_labels(snap.gpu_labels, snap.samples, snap.gpus)
    drivers = tuple((DRIVER_LABEL[r], snap.driver_version) for r in schema_releases(schema))
    out: dict[int, Labels] = {}
    for g in snap.gpus:
        minor = g.minor if g.minor is not None else g.index
        labels: Labels = (
            ("gpu", str(g.index)), ("UUID", g.uuid), ("pci_bus_id", g.pci_bus_id), ("device", f"nvidia{minor}"),
            ("modelName", g.name), (hostname_label, snap.node_name), *drivers,
        )
        holder = {JOB_LABELS.get(k, k): v for k, v in extra.get(g.uuid, {}).items()}
        out[g.index] = labels + tuple(sorted(holder.items()))
    return out


def _counter(fams: FamilySet, name: str, help_text: str) -> Family:
    """dcgm-exporter's counters keep their exact names (no ``_total``) and are typed ``counter``."""
    fam = fams.get(name, help_text, "counter")
    fam.suffixed = False
    return fam


def add_dcgm_families(fams: FamilySet, snap: ExportSnapshot, hostname_label: str = AUTO_HOSTNAME,
                      schema: str = DEFAULT_SCHEMA) -> None:
    """Add the dcgm-exporter view of ``snap``'s samples to ``fams``: the fields of ``schema``
    (``4.10``, ``4.8`` or ``both``), the node label named ``hostname_label`` (``auto``: the schema's)."""
    fields = fields_of(schema)
    by_source: dict[str, list[DcgmField]] = {}
    for f in fields:
        by_source.setdefault(f.source, []).append(f)
    label_sets = dcgm_label_sets(snap, hostname_label_of(schema, hostname_label), schema)
    # field name → (gpu index, kept labels) → value (summed for sum_over fields)
    values: dict[str, dict[tuple[int, Labels], float]] = {}
    clock_masks: dict[int, int] = {}
    for s in snap.samples:
        if s.gpu is None or s.gpu not in label_sets:
            continue
        if s.name == "gpu_throttle_reason_active":
            bit = CLOCK_EVENT_BITS.get(dict(s.labels).get("reason", ""))
            if bit is not None:
                clock_masks[s.gpu] = clock_masks.get(s.gpu, 0) | (bit if s.value else 0)
            continue
        matching = by_source.get(s.name)
        if not matching:
            continue
        own = dict(s.labels) if s.labels else {}
        for field in matching:
            if field.match and any(own.get(k) != v for k, v in field.match):
                continue
            kept: Labels = ()
            if field.keep_labels:
                kept = tuple((k, own.get(k, "")) for k in field.keep_labels)
            key = (s.gpu, kept)
            acc = values.setdefault(field.name, {})
            value = s.value * field.scale
            acc[key] = (acc.get(key, 0.0) + value) if field.sum_over else value
    for field in fields:
        series = values.get(field.name)
        if not series:
            continue
        fam = (_counter(fams, field.name, field.help) if field.type == "counter"
               else fams.get(field.name, field.help, "gauge"))
        for (gpu, kept), value in series.items():
            if field.name.startswith("DCGM_FI_DEV_XID_ERROR"):  # dcgm-exporter names the code on the series
                code = int(value)
                kept = (("err_code", str(code)), ("err_msg", xid_message(code)))
            fam.add(value, kept, label_sets[gpu])
    releases = set(schema_releases(schema))
    for name in CLOCK_REASON_FAMILIES:
        if not clock_masks or not releases & set(CLOCK_REASON_SCHEMAS[name]):
            continue
        fam = fams.get(name, _CLOCK_REASONS_HELP, "gauge")
        for idx, mask in sorted(clock_masks.items()):
            fam.add(float(mask), (), label_sets[idx])


__all__ = ["CLOCK_EVENT_BITS", "CLOCK_REASON_FAMILIES", "DCGM_LABELS", "DEFAULT_SCHEMA", "FIELDS", "SCHEMA_CHOICES",
           "DcgmField", "add_dcgm_families", "fields_of", "schema_releases"]
