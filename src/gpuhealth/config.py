"""One typed configuration: defaults that work out of the box, then a YAML file, then environment
variables (``GPUHEALTH_<SECTION>_<FIELD>``), then command-line flags — later wins.

Each subsystem owns one section. Add fields to your section only; every field needs a default.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml


class ConfigError(ValueError):
    """A bad config file, variable or flag; the message names the source and the key."""


@dataclass(slots=True)
class CollectorsConfig:
    fast_interval_s: float = 5.0
    slow_interval_s: float = 60.0
    timeout_s: float = 10.0  # per collector run; a run past this is reported failed
    history_len: int = 64
    expected_gpus: int | None = None  # None: trust NVML/sysfs agreement
    expected_nvlinks: int | None = None  # None: from the GPU's own capabilities
    thresholds_file: str | None = None  # None: bundled catalog/thresholds.yaml
    disabled: list[str] = field(default_factory=list)
    sysfs_root: str = "/"
    kmsg_path: str | None = None  # None: /dev/kmsg when readable


@dataclass(slots=True)
class AgentConfig:
    listen: str = "0.0.0.0:9400"
    node_name: str = ""  # default: hostname
    json_logs: bool = False
    log_level: str = "info"
    dcgm_compat: bool = False
    nvml_snapshot: str | None = None  # recording or scenario → simulated backend
    coordinator: str | None = None  # host:port of the coordinator, None = standalone
    state_dir: str = "/var/lib/gpuhealth"
    socket_path: str = "/run/gpuhealth/agent.sock"  # instrument hook → agent
    # GPU → pod attribution (kubelet PodResources API); used only when the socket exists.
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    slurm_job_dir: str | None = None  # GPU → Slurm job mapping files (written by the prolog)


@dataclass(slots=True)
class DiagConfig:
    enabled: bool = False  # periodic diagnostics from the agent
    interval_s: float = 3600.0
    gpu_seconds_per_hour: float = 10.0  # per-GPU GPU-time budget
    run_on_busy_gpus: bool = False
    golden_dir: str = "/var/lib/gpuhealth/golden"
    state_dir: str = ""  # budget ledger + per-GPU locks; "" → <agent.state_dir>/diag (user cache if unwritable)
    timeout_s: float = 600.0  # one diagnostic child process, killed past this
    busbw_thresholds_file: str | None = None  # YAML {topology: {collective: {size_bytes: GB/s}}}; None: built in
    busbw_min_fraction: float = 0.8  # busbw.low below this fraction of the reference curve
    busbw_judge_min_bytes: int = 64 * 1024 * 1024  # judge only sizes this large (small ones are latency)
    bandwidth_hbm_fraction: float = 0.85  # bandwidth.low below this fraction of the model's copy bandwidth
    bandwidth_pcie_fraction: float = 0.75  # ... of what the slot's max PCIe speed × width carries


@dataclass(slots=True)
class CoordinatorConfig:
    listen: str = "0.0.0.0:9500"
    metrics_listen: str = "0.0.0.0:9501"
    db_path: str = "/var/lib/gpuhealth/coordinator.db"
    hang_k: float = 10.0  # hang when no rank progressed for max(k × typical step, floor)
    hang_floor_s: float = 60.0
    retention_days: float = 30.0
    token: str | None = None
    # Actions on nodes (LiveTriage: dumps and py-spy; RunDiagnostic) need an operator: this token, or
    # a client certificate whose CN/SAN is one of operator_names (comma-separated). Agent credentials
    # only report and read. Without either (and with auth on), those RPCs are refused.
    operator_token: str | None = None
    operator_names: str = ""
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    # Client side (agent link, CLI queries) under mutual TLS: this node's certificate; CA = tls_ca.
    client_tls_cert: str | None = None
    client_tls_key: str | None = None
    evidence_dir: str = ""  # hang evidence (FR dumps, stacks); "" = "evidence" beside db_path
    evidence_timeout_s: float = 20.0  # how long a hang investigation waits for every rank's answer
    tick_s: float = 0.5  # detection period (stragglers, hangs)
    heartbeat_interval_s: float = 10.0  # asked of agents; also how fast a finished job is noticed
    step_retention_hours: float = 24.0  # raw step batches; verdicts/jobs keep retention_days
    straggler_budget_records_s: float = 50_000.0  # per job; above it, detection samples steps
    spool_max_records: int = 200_000  # agent side: records kept while the coordinator is away
    # Agent side: step records are packed into one message per job this often. Larger batches cost the
    # coordinator less per record (benchmarks/coordinator_load.py); detection waits up to this long.
    link_batch_interval_s: float = 1.0
    max_inflight: int = 256  # records an agent may send before waiting for an ack
    warm_start_s: float = 600.0  # step batches replayed into job state after a restart
    forget_job_after_s: float = 3600.0  # a finished job leaves memory after this long without records

    def resolved_evidence_dir(self) -> str:
        """Where hang evidence goes: ``evidence_dir``, or "evidence" beside the database."""
        return self.evidence_dir or str(Path(self.db_path).resolve().parent / "evidence")


@dataclass(slots=True)
class Config:
    collectors: CollectorsConfig = field(default_factory=CollectorsConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    diag: DiagConfig = field(default_factory=DiagConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)

    @property
    def node_name(self) -> str:
        return self.agent.node_name or socket.gethostname()


def _coerce(value: Any, hint: Any, where: str) -> Any:
    text = str(hint)
    try:
        if value is None:
            if "None" in text:
                return None
            raise ConfigError(f"{where}: may not be empty")
        if hint is bool or text == "bool":
            if isinstance(value, bool):
                return value
            low = str(value).strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        if hint is float or text.startswith("float"):
            return float(value)
        if hint is int or text.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ConfigError(f"{where}: expected an integer, got {value!r}")
            return int(value)
        if text.startswith("list"):
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list):
                raise ConfigError(f"{where}: expected a list, got {value!r}")
            return [str(v) for v in value]
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _apply(cfg: Config, data: Mapping[str, Any], source: str) -> None:
    for section_name, values in data.items():
        section = getattr(cfg, section_name, None)
        if section is None or not dataclasses.is_dataclass(section):
            raise ConfigError(f"{source}: unknown section '{section_name}'")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: section '{section_name}' must be a mapping")
        hints = get_type_hints(type(section))
        for key, value in values.items():
            if key not in hints:
                raise ConfigError(f"{source}: unknown key '{section_name}.{key}'")
            setattr(section, key, _coerce(value, hints[key], f"{source}: {section_name}.{key}"))


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Defaults ← file ← ``GPUHEALTH_SECTION_KEY`` variables ← ``overrides`` (flags)."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        _apply(cfg, data, str(p))
    env = os.environ if env is None else env
    from_env: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(cfg):
        prefix = f"GPUHEALTH_{f.name.upper()}_"
        section = getattr(cfg, f.name)
        for key in get_type_hints(type(section)):
            var = prefix + key.upper()
            if var in env:
                from_env.setdefault(f.name, {})[key] = env[var]
    _apply(cfg, from_env, "environment")
    if overrides:
        _apply(cfg, {k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in overrides.items()}, "flags")
    return cfg


__all__ = ["AgentConfig", "CollectorsConfig", "Config", "ConfigError", "CoordinatorConfig", "DiagConfig", "load_config"]
