"""``--dcgm-compat``: the same readings again under dcgm-exporter's names, units and labels, so the
standard dcgm-exporter Grafana dashboard (grafana.com 12239) and alerts written for it keep working.

Names, units and types follow dcgm-exporter's ``etc/default-counters.csv`` (the defaults plus the
commented-out ECC, retired-page, violation and NVLink rows, which we fill in, and the profiling
fields NVML's GPM gives without DCGM). Labels are dcgm-exporter's: ``gpu``, ``UUID``,
``pci_bus_id``, ``device`` (``nvidia<minor>``), ``modelName``, ``Hostname`` (as dcgm-exporter 4.5-4.8 write it;
``agent.dcgm_hostname_label: hostname`` for the lower-case form of its unreleased main branch),
``DCGM_FI_DRIVER_VERSION``, plus ``pod``/``namespace``/``container`` from the agent's label
provider; ``DCGM_FI_DEV_XID_ERRORS`` also carries ``err_code`` and ``err_msg`` as dcgm-exporter's
does. dcgm-exporter's counters keep their names without ``_total``; prometheus-client
would append it to a counter, so they are exposed untyped (``unknown``) under the exact name —
PromQL treats both alike. The mapping table in ``docs/metrics.md`` is generated from ``FIELDS``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuhealth.collectors.xid import xid_message
from gpuhealth.exporters import ExportSnapshot
from gpuhealth.exporters.families import FamilySet, Labels, gpu_holder_labels

MIB = float(1 << 20)
# dcgm-exporter 4.5.x-4.8.x (what released dashboards and alert rules were written against) name the node
# ``Hostname``; only its unreleased main branch writes ``hostname``: ``agent.dcgm_hostname_label`` picks.
HOSTNAME_LABELS = ("Hostname", "hostname")
DEFAULT_HOSTNAME_LABEL = "Hostname"
DCGM_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", DEFAULT_HOSTNAME_LABEL, "DCGM_FI_DRIVER_VERSION")
NS_PER_S = 1e9

# NVML clock-event reason bits (nvml.h nvmlClocksEventReason*), keyed by the throttle collector's
# ``reason`` label; DCGM_FI_DEV_CLOCKS_EVENT_REASONS is this bitmask.
CLOCK_EVENT_BITS: dict[str, int] = {
    "gpu_idle": 0x1, "applications_clocks": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8, "sync_boost": 0x10,
    "sw_thermal": 0x20, "hw_thermal": 0x40, "hw_power_brake": 0x80, "display_clocks": 0x100,
}


@dataclass(frozen=True, slots=True)
class DcgmField:
    """One dcgm-exporter series computed from one of our samples."""

    name: str  # dcgm-exporter's metric name
    type: str  # dcgm-exporter's declared type (counter/gauge); counters are exposed untyped
    help: str  # dcgm-exporter's help text
    source: str  # our sample name (without the gpuhealth_ prefix)
    match: tuple[tuple[str, str], ...] = ()  # our sample's labels that select it
    scale: float = 1.0  # ours × scale = dcgm's unit
    keep_labels: tuple[str, ...] = ()  # our labels carried over (e.g. xid)
    sum_over: str | None = None  # label summed away (NVLink links → _TOTAL)
    unit: str = ""  # dcgm-exporter's unit, for docs/metrics.md
    note: str = ""  # what else a reader must know, for docs/metrics.md


FIELDS: tuple[DcgmField, ...] = (
    DcgmField("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", "gpu_clock_hertz",
              (("clock", "sm"),), 1e-6, unit="MHz"),
    DcgmField("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", "gpu_clock_hertz",
              (("clock", "memory"),), 1e-6, unit="MHz"),
    DcgmField("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", "gpu_temperature_celsius",
              (("sensor", "memory"),), unit="°C"),
    DcgmField("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", "gpu_temperature_celsius",
              (("sensor", "gpu"),), unit="°C"),
    DcgmField("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", "gpu_power_watts", unit="W"),
    DcgmField("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "Power management limit (in W).", "gpu_power_limit_watts",
              unit="W"),
    DcgmField("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ).",
              "gpu_energy_joules", scale=1e3, unit="mJ"),
    DcgmField("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.", "gpu_pcie_replay",
              unit="replays"),
    DcgmField("DCGM_FI_DEV_PCIE_LINK_GEN", "gauge", "PCIe current link generation.", "gpu_pcie_link_generation",
              (("which", "current"),), unit="generation"),
    DcgmField("DCGM_FI_DEV_PCIE_LINK_WIDTH", "gauge", "PCIe current link width.", "gpu_pcie_link_width",
              (("which", "current"),), unit="lanes"),
    DcgmField("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", "gpu_utilization_ratio", scale=100.0,
              unit="%"),
    DcgmField("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", "gpu_memory_utilization_ratio",
              scale=100.0, unit="%"),
    DcgmField("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", "gpu_encoder_utilization_ratio",
              scale=100.0, unit="%"),
    DcgmField("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", "gpu_decoder_utilization_ratio",
              scale=100.0, unit="%"),
    DcgmField("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", "gpu_xid_last",
              unit="XID code", note="value of the last active XID, 0 when none; labels `err_code`, `err_msg`"),
    DcgmField("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", "gpu_memory_free_bytes",
              scale=1 / MIB, unit="MiB"),
    DcgmField("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", "gpu_memory_used_bytes",
              scale=1 / MIB, unit="MiB"),
    DcgmField("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).",
              "gpu_memory_reserved_bytes", scale=1 / MIB, unit="MiB"),
    DcgmField("DCGM_FI_DEV_FB_TOTAL", "gauge", "Framebuffer memory total (in MiB).", "gpu_memory_total_bytes",
              scale=1 / MIB, unit="MiB"),
    DcgmField("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors.",
              "gpu_ecc_errors", (("type", "corrected"), ("scope", "volatile")), unit="errors"),
    DcgmField("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors.",
              "gpu_ecc_errors", (("type", "uncorrected"), ("scope", "volatile")), unit="errors"),
    DcgmField("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter", "Total number of single-bit persistent ECC errors.",
              "gpu_ecc_errors", (("type", "corrected"), ("scope", "aggregate")), unit="errors"),
    DcgmField("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter", "Total number of double-bit persistent ECC errors.",
              "gpu_ecc_errors", (("type", "uncorrected"), ("scope", "aggregate")), unit="errors"),
    DcgmField("DCGM_FI_DEV_RETIRED_SBE", "counter", "Total number of retired pages due to single-bit errors.",
              "gpu_retired_pages", (("cause", "sbe"),), unit="pages", note="GPUs before Ampere only"),
    DcgmField("DCGM_FI_DEV_RETIRED_DBE", "counter", "Total number of retired pages due to double-bit errors.",
              "gpu_retired_pages", (("cause", "dbe"),), unit="pages", note="GPUs before Ampere only"),
    DcgmField("DCGM_FI_DEV_RETIRED_PENDING", "counter", "Total number of pages pending retirement.",
              "gpu_retired_pages_pending", unit="0/1", note="GPUs before Ampere only"),
    DcgmField("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
              "Number of remapped rows for uncorrectable errors", "gpu_remapped_rows", (("cause", "uncorrectable"),),
              unit="rows"),
    DcgmField("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors",
              "gpu_remapped_rows", (("cause", "correctable"),), unit="rows"),
    DcgmField("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
              "gpu_row_remap_failed", unit="0/1"),
    DcgmField("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Whether remapping of rows is pending",
              "gpu_row_remap_pending", unit="0/1"),
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
    DcgmField("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter",
              "Total number of NVLink flow-control CRC errors.", "gpu_nvlink_errors", (("counter", "crc"),),
              sum_over="link", unit="errors"),
    DcgmField("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink retries.",
              "gpu_nvlink_errors", (("counter", "replay"),), sum_over="link", unit="errors"),
    DcgmField("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink recovery errors.",
              "gpu_nvlink_errors", (("counter", "recovery"),), sum_over="link", unit="errors"),
    DcgmField("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
              "Total number of NVLink bandwidth counters for all lanes.", "gpu_nvlink_traffic_bytes",
              sum_over="direction", unit="bytes", note="header and payload, both directions"),
    # Profiling fields: DCGM's profiling module, or NVML's GPM (Hopper and later) without DCGM.
    DcgmField("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.",
              "gpu_graphics_active_ratio", unit="ratio", note="NVML GPM GRAPHICS_UTIL"),
    DcgmField("DCGM_FI_PROF_SM_ACTIVE", "gauge", "The ratio of cycles an SM has at least 1 warp assigned.",
              "gpu_sm_active_ratio", unit="ratio", note="NVML GPM SM_UTIL"),
    DcgmField("DCGM_FI_PROF_SM_OCCUPANCY", "gauge", "The ratio of number of warps resident on an SM.",
              "gpu_sm_occupancy_ratio", unit="ratio", note="NVML GPM SM_OCCUPANCY"),
    DcgmField("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active.",
              "gpu_tensor_active_ratio", unit="ratio", note="NVML GPM ANY_TENSOR_UTIL"),
    DcgmField("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
              "Ratio of cycles the device memory interface is active sending or receiving data.",
              "gpu_dram_active_ratio", unit="ratio", note="NVML GPM DRAM_BW_UTIL"),
    DcgmField("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", "The rate of data transmitted over the PCIe bus - including "
              "both protocol headers and data payloads - in bytes per second.", "gpu_pcie_throughput_bytes_per_second",
              (("direction", "tx"),), unit="bytes/s", note="NVML GPM PCIE_TX_PER_SEC"),
    DcgmField("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", "The rate of data received over the PCIe bus - including "
              "both protocol headers and data payloads - in bytes per second.", "gpu_pcie_throughput_bytes_per_second",
              (("direction", "rx"),), unit="bytes/s", note="NVML GPM PCIE_RX_PER_SEC"),
)

# The throttle reasons as one bitmask, under today's name and the older one dashboards still use.
CLOCK_REASON_FAMILIES = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
_CLOCK_REASONS_HELP = "Current clock event (throttle) reasons, NVML bitmask."
_BY_SOURCE: dict[str, tuple[DcgmField, ...]] = {}
for _f in FIELDS:
    _BY_SOURCE[_f.source] = (*_BY_SOURCE.get(_f.source, ()), _f)


def dcgm_label_sets(snap: ExportSnapshot, hostname_label: str = DEFAULT_HOSTNAME_LABEL) -> dict[int, Labels]:
    extra = gpu_holder_labels(snap.gpu_labels, snap.samples, snap.gpus)
    out: dict[int, Labels] = {}
    for g in snap.gpus:
        minor = g.minor if g.minor is not None else g.index
        labels: Labels = (
            ("gpu", str(g.index)), ("UUID", g.uuid), ("pci_bus_id", g.pci_bus_id), ("device", f"nvidia{minor}"),
            ("modelName", g.name), (hostname_label, snap.node_name), ("DCGM_FI_DRIVER_VERSION", snap.driver_version),
        )
        out[g.index] = labels + tuple(sorted(extra.get(g.uuid, {}).items()))
    return out


def add_dcgm_families(fams: FamilySet, snap: ExportSnapshot, hostname_label: str = DEFAULT_HOSTNAME_LABEL) -> None:
    """Add the dcgm-exporter view of ``snap``'s samples to ``fams`` (the node label named ``hostname_label``)."""
    label_sets = dcgm_label_sets(snap, hostname_label)
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
        fields = _BY_SOURCE.get(s.name)
        if not fields:
            continue
        own = dict(s.labels) if s.labels else {}
        for field in fields:
            if field.match and any(own.get(k) != v for k, v in field.match):
                continue
            kept: Labels = ()
            if field.keep_labels:
                kept = tuple((k, own.get(k, "")) for k in field.keep_labels)
            key = (s.gpu, kept)
            acc = values.setdefault(field.name, {})
            value = s.value * field.scale
            acc[key] = (acc.get(key, 0.0) + value) if field.sum_over else value
    for field in FIELDS:
        series = values.get(field.name)
        if not series:
            continue
        # dcgm-exporter's counters have no _total: exposed untyped under the exact name
        fam = fams.get(field.name, field.help, "unknown" if field.type == "counter" else "gauge")
        for (gpu, kept), value in series.items():
            if field.name == "DCGM_FI_DEV_XID_ERRORS":  # dcgm-exporter names the code on the series
                code = int(value)
                kept = (("err_code", str(code)), ("err_msg", xid_message(code)))
            fam.add(value, kept, label_sets[gpu])
    if clock_masks:
        for name in CLOCK_REASON_FAMILIES:
            fam = fams.get(name, _CLOCK_REASONS_HELP, "gauge")
            for idx, mask in sorted(clock_masks.items()):
                fam.add(float(mask), (), label_sets[idx])


__all__ = ["CLOCK_EVENT_BITS", "CLOCK_REASON_FAMILIES", "DCGM_LABELS", "FIELDS", "DcgmField", "add_dcgm_families"]
