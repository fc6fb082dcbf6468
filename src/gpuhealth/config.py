"""One typed configuration: defaults that work out of the box, then a YAML file, then environment
variables (``GPUHEALTH_<SECTION>_<FIELD>``), then command-line flags — later wins.

Each subsystem owns one section. Add fields to your section only; every field needs a default.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml


class ConfigError(ValueError):
    """A bad config file, variable or flag; the message names the source and the key."""


class FlagError(ConfigError):
    """A command-line flag's value (``overrides``) that fails its key's check: a usage error, not a config that
    could not be used. ``key`` is the ``section.key`` it stands for."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


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
    # Ethernet NICs the ethernet collector judges; empty: every physical one (a ``device`` link; not lo, veth,
    # docker*, bridges). Name veths here to have them judged (a cluster of namespaces in tests).
    net_interfaces: list[str] = field(default_factory=list)
    expected_net_speed_mbps: int | None = None  # None: the fastest NIC of the same driver on the node
    expected_ib_rate_gbps: float | None = None  # None: the fastest active port of the same HCA model


@dataclass(slots=True)
class AgentConfig:
    listen: str = "0.0.0.0:9502"  # not 9400: dcgm-exporter's, so both run side by side
    node_name: str = ""  # default: hostname
    json_logs: bool = False
    log_level: str = "info"
    dcgm_compat: bool = False
    # Which dcgm-exporter names --dcgm-compat serves (exporters/dcgm.py): "4.10" (4.9 and later: DCGM's renamed
    # fields, base units), "4.8" (4.5-4.8: what existing dashboards and alert rules select on) or "both" (migration).
    dcgm_schema: str = "4.10"
    # The node label of the dcgm-exporter series: "auto" names it as the schema's release does ("Hostname" in
    # 4.5.0-4.8.2, "hostname" from 4.8.3 on), or "Hostname" / "hostname" as asked.
    dcgm_hostname_label: str = "auto"
    # NVLink series per link (18 links x 4 families a GPU) instead of summed per GPU; /metrics?nvlink=link
    # gives one scrape the per-link view either way.
    nvlink_per_link: bool = False
    nvml_snapshot: str | None = None  # recording or scenario → simulated backend
    coordinator: str | None = None  # host:port of the coordinator, None = standalone
    state_dir: str = "/var/lib/gpuhealth"
    socket_path: str = "/run/gpuhealth/agent.sock"  # instrument hook → agent
    # The rank socket is served by an unprivileged child (docs/security.md "Privilege separation"): its uid
    # (a name or number; when the agent runs as root), its address-space cap and its lifetime CPU-time budget
    # (spent: a fresh child). ``rank_process: false`` serves it in the agent's own process: for debugging only.
    rank_process: bool = True
    rank_process_user: str = "nobody"
    rank_process_memory_mib: int = 384
    rank_process_cpu_seconds: int = 3600
    # GPU → pod attribution (kubelet PodResources API); used only when the socket exists.
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    slurm_job_dir: str | None = None  # GPU → Slurm job mapping files (written by the prolog)
    # TLS and basic auth on /metrics and /health: a web config file as Prometheus' exporters read it
    # (exporter-toolkit's --web.config.file; docs/security.md). None: plain HTTP, no auth.
    web_config_file: str | None = None


@dataclass(slots=True)
class DiagConfig:
    # Screening from the agent (docs/diagnostics.md): idle GPUs only, within the budget below, aborted when a
    # job starts; never on a simulated backend. ``enabled: false`` turns it off.
    enabled: bool = True
    interval_s: float = 3600.0  # a scheduled screen (SDC + memory bandwidth) this often
    gpu_seconds_per_hour: float = 10.0  # per-GPU GPU-time budget
    run_on_busy_gpus: bool = False
    golden_dir: str = "/var/lib/gpuhealth/golden"  # user cache until writable; then old places merged in
    state_dir: str = ""  # budget ledger + per-GPU locks; "" → <agent.state_dir>/diag (user cache if unwritable)
    timeout_s: float = 600.0  # one diagnostic child process, killed past this
    busbw_thresholds_file: str | None = None  # YAML {topology: {collective: {size_bytes: GB/s}}}; None: built in
    busbw_min_fraction: float = 0.8  # busbw.low below this fraction of the reference curve
    busbw_judge_min_bytes: int = 64 * 1024 * 1024  # judge only sizes this large (small ones are latency)
    bandwidth_hbm_fraction: float = 0.85  # bandwidth.low below this fraction of the model's copy bandwidth
    bandwidth_pcie_fraction: float = 0.75  # ... of what the slot's max PCIe speed × width carries
    # A file here (the Slurm prolog writes job-<id>) aborts a running screen and holds off new ones;
    # "" = no block directory (idle-only still applies)
    screen_block_dir: str = "/run/gpuhealth/screen-block"


@dataclass(slots=True)
class CoordinatorConfig:
    listen: str = "0.0.0.0:9500"
    metrics_listen: str = "0.0.0.0:9501"
    # TLS and basic auth on /metrics: a web config file as Prometheus' exporters read it (exporter-toolkit's
    # --web.config.file; docs/security.md). None: plain HTTP, no auth.
    metrics_web_config_file: str | None = None
    db_path: str = "/var/lib/gpuhealth/coordinator.db"
    hang_k: float = 10.0  # hang when no rank progressed for max(k × typical step, floor)
    hang_floor_s: float = 60.0
    retention_days: float = 30.0
    # Node identity (docs/security.md). Agent side: the bearer token this node presents — its node
    # token (``gpuhealth token``), or a Kubernetes ServiceAccount token — from ``token`` (the
    # environment: GPUHEALTH_COORDINATOR_TOKEN) or ``token_file`` (read again at every connect:
    # projected tokens rotate). Coordinator side: ``node_secret_file`` verifies node tokens (HMAC of
    # the node name); an agent given it derives its own token (every node then holds the secret).
    token: str | None = None
    token_file: str | None = None
    node_secret_file: str | None = None
    # Compatibility: ``token`` on the coordinator as ONE token every agent shares — any holder can
    # report as any node. Off: a coordinator with ``token`` and without this refuses to start.
    shared_token: bool = False
    # No credential at all (no node secret, TokenReview, mTLS or shared token) is for loopback: a coordinator
    # that would listen beyond it refuses to start unless this says so. Even then only callers on the
    # coordinator's own host may act on nodes (LiveTriage, RunDiagnostic).
    allow_unauthenticated: bool = False
    # Kubernetes: agents present their ServiceAccount token (audience ``token_review_audience``); the
    # coordinator asks the API server (TokenReview) and binds the node to the pod's node. "" = off,
    # "in-cluster", or the API server's https URL (then ``token_review_ca`` and the coordinator's own
    # credential ``token_review_credential_file``; in-cluster defaults otherwise).
    token_review: str = ""
    token_review_ca: str | None = None
    token_review_credential_file: str | None = None
    token_review_audience: str = "gpuhealth"
    agent_service_accounts: str = "system:serviceaccount:gpuhealth:gpuhealth-agent"
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
    # Agent side: step records received from ranks reach the disk within this long (one group commit),
    # so an agent killed with SIGKILL loses at most this much of them (benchmarks/hardening.py).
    spool_commit_s: float = 0.05
    max_inflight: int = 256  # records an agent may send before waiting for an ack
    warm_start_s: float = 600.0  # step batches replayed into job state after a restart
    forget_job_after_s: float = 3600.0  # a finished job leaves memory after this long without records
    # Fleet screening (issue 18). Coverage: GPUs with a completed (pass/fail) screen within this window.
    screen_window_s: float = 86_400.0
    # The rotation: turns (``ScreenTurn``) tell agents when a scheduled screen may start. Off: no turns
    # are sent and every agent keeps its own schedule.
    screen_rotation: bool = True
    screen_concurrency: float = 0.1  # share of connected nodes holding a turn at once (at least one node)
    screen_turn_s: float = 1800.0  # how long a turn lasts; a node that reports every GPU screened ends it early
    screen_history: int = 32  # screens kept per GPU (besides the newest of each level and result)

    def metrics_address(self) -> str | None:
        """``metrics_listen``, or None where it is turned off ("off", "none" or empty)."""
        return None if self.metrics_listen.strip().lower() in _METRICS_OFF else self.metrics_listen

    def resolved_evidence_dir(self) -> str:
        """Where hang evidence goes: ``evidence_dir``, or "evidence" beside the database."""
        return self.evidence_dir or str(Path(self.db_path).resolve().parent / "evidence")


@dataclass(slots=True)
class ZeroCodeConfig:
    # Zero-code reach (docs/zero-code.md): unmodified PyTorch/NCCL jobs found from NVML and /proc, judged
    # through NCCL's RAS service. The agent's ``agent/zerocode/watcher.ZeroCodeSettings`` takes these names.
    enabled: bool = True
    poll_interval_s: float = 5.0  # discovery and one RAS query per job this often
    hang_threshold_s: float = 30.0  # a rank behind the others this long (over >= 2 polls): a hang
    dump_on_hang: bool = True  # on a hang, every local rank's flight-recorder dump through its FIFO
    periodic_dump_s: float = 300.0  # jobs launched with the pipe variables: dumped this often for stragglers; 0 never
    stacks: bool = True  # py-spy stacks with a hang's evidence
    stacks_native: bool = False  # ... with native frames (slower)
    keep_evidence: int = 16  # evidence folders kept on the node (oldest removed first)
    # On a simulated backend too: the scenario's ComputeRunningProcesses are taken as this machine's processes
    # (benchmarks/agent_footprint.py, demos). Off by default: a recording's pids are another machine's.
    simulated_processes: bool = False


@dataclass(slots=True)
class Config:
    collectors: CollectorsConfig = field(default_factory=CollectorsConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    diag: DiagConfig = field(default_factory=DiagConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    zerocode: ZeroCodeConfig = field(default_factory=ZeroCodeConfig)

    @property
    def node_name(self) -> str:
        return self.agent.node_name or socket.gethostname()


# Every numeric key's allowed range, inclusive: (low, high), low excluded where the key names a time
# that must pass (``_ABOVE``). A numeric key missing here is a bug the tests catch.
_RANGES: dict[str, tuple[float, float]] = {
    "agent.rank_process_memory_mib": (64, 65_536),  # under 64 MiB the interpreter alone does not start
    "agent.rank_process_cpu_seconds": (60, 10_000_000),
    "collectors.fast_interval_s": (0.0, 86_400.0),
    "collectors.slow_interval_s": (0.0, 86_400.0),
    "collectors.timeout_s": (0.0, 3_600.0),
    "collectors.history_len": (1, 1_000_000),
    "collectors.expected_gpus": (0, 4_096),
    "collectors.expected_nvlinks": (0, 1_024),
    "collectors.expected_net_speed_mbps": (1, 10_000_000),  # up to 10 Tb/s
    "collectors.expected_ib_rate_gbps": (0.0, 100_000.0),
    "diag.interval_s": (0.0, 366 * 86_400.0),
    "diag.gpu_seconds_per_hour": (0.0, 3_600.0),
    "diag.timeout_s": (0.0, 86_400.0),
    "diag.busbw_min_fraction": (0.0, 1.0),
    "diag.busbw_judge_min_bytes": (0, 1 << 40),
    "diag.bandwidth_hbm_fraction": (0.0, 1.0),
    "diag.bandwidth_pcie_fraction": (0.0, 1.0),
    "coordinator.hang_k": (0.0, 1e6),
    "coordinator.hang_floor_s": (0.0, 366 * 86_400.0),
    "coordinator.retention_days": (0.0, 36_600.0),
    "coordinator.evidence_timeout_s": (0.0, 86_400.0),
    "coordinator.tick_s": (0.0, 3_600.0),
    "coordinator.heartbeat_interval_s": (0.0, 86_400.0),
    "coordinator.step_retention_hours": (0.0, 876_000.0),
    "coordinator.straggler_budget_records_s": (0.0, 1e12),
    "coordinator.spool_max_records": (1, 1 << 40),
    "coordinator.link_batch_interval_s": (0.0, 3_600.0),
    "coordinator.spool_commit_s": (0.0, 60.0),
    "coordinator.max_inflight": (1, 1 << 20),
    "coordinator.warm_start_s": (0.0, 366 * 86_400.0),
    "coordinator.forget_job_after_s": (0.0, 366 * 86_400.0),
    "coordinator.screen_window_s": (0.0, 366 * 86_400.0),
    "coordinator.screen_concurrency": (0.0, 1.0),
    "coordinator.screen_turn_s": (0.0, 7 * 86_400.0),
    "coordinator.screen_history": (1, 100_000),
    "zerocode.poll_interval_s": (0.0, 3_600.0),
    "zerocode.hang_threshold_s": (0.0, 86_400.0),
    "zerocode.periodic_dump_s": (0.0, 7 * 86_400.0),
    "zerocode.keep_evidence": (0, 100_000),
}
# Keys whose low end is excluded: an interval, timeout or factor of zero would spin or never fire.
_ABOVE = frozenset({
    "collectors.fast_interval_s", "collectors.slow_interval_s", "collectors.timeout_s", "diag.interval_s",
    "diag.timeout_s", "coordinator.hang_k", "coordinator.retention_days", "coordinator.evidence_timeout_s",
    "coordinator.tick_s", "coordinator.heartbeat_interval_s", "coordinator.step_retention_hours",
    "coordinator.straggler_budget_records_s", "coordinator.link_batch_interval_s", "coordinator.spool_commit_s",
    "coordinator.forget_job_after_s", "coordinator.screen_window_s", "coordinator.screen_concurrency",
    "coordinator.screen_turn_s", "zerocode.poll_interval_s", "zerocode.hang_threshold_s",
})
# Addresses, checked when read so a typo is one line naming the key (not a bind error at start):
# "listen" host:port to bind (port 0: any free one), "off" where metrics can be turned off, "target" a
# host:port to connect to (or a gRPC target URI such as dns:///host:port).
_ADDRESSES: dict[str, str] = {
    "agent.listen": "listen",
    "agent.coordinator": "target",
    "coordinator.listen": "listen",
    "coordinator.metrics_listen": "listen_or_off",
}
_METRICS_OFF = ("", "off", "none")
# Text keys that take one of a few values.
_CHOICES: dict[str, tuple[str, ...]] = {"agent.dcgm_hostname_label": ("auto", "Hostname", "hostname"),
                                        "agent.dcgm_schema": ("4.10", "4.8", "both")}
_MAX_TEXT = 4_096  # a path, an address, a name: never a document
_MAX_LIST = 1_024
_MAX_FILE_BYTES = 1 << 20  # a config file is a page of YAML


def json_schema() -> dict[str, Any]:
    """The config file as a JSON Schema (draft-07): every section and key, its type, range and choices, and no
    other key — what ``load_config`` accepts from a file, so a chart (``scripts/gen_chart_schema.py``) refuses
    a typo when it renders instead of every pod refusing it at start. Text keys also take numbers (the
    loader reads ``port: 9502`` as text); numbers and booleans take their YAML types only (the loader also
    reads "5" and "yes", which only a variable needs)."""
    sections: dict[str, Any] = {}
    for section_name, section_type in get_type_hints(Config).items():
        hints = get_type_hints(section_type)
        keys = {key: _key_schema(f"{section_name}.{key}", hint) for key, hint in hints.items()}
        sections[section_name] = {"type": "object", "additionalProperties": False, "properties": keys}
    return {"type": "object", "additionalProperties": False, "properties": sections}


def _key_schema(name: str, hint: Any) -> dict[str, Any]:
    text = str(hint)
    optional = "None" in text
    schema: dict[str, Any]
    if hint is bool:
        schema = {"type": "boolean"}
    elif hint is float or hint is int or text.startswith(("float", "int")):
        schema = {"type": "integer" if hint is int or text.startswith("int") else "number"}
        if name in _RANGES:
            low, high = _RANGES[name]
            schema["exclusiveMinimum" if name in _ABOVE else "minimum"] = low
            schema["maximum"] = high
    elif text.startswith("list"):
        # a list, or one comma-separated text (as a variable gives it)
        item = {"type": ["string", "number"], "maxLength": _MAX_TEXT}
        return {"type": ["array", "string"], "items": item, "maxItems": _MAX_LIST, "maxLength": _MAX_TEXT}
    elif name in _CHOICES:
        schema = {"enum": list(_CHOICES[name])}
    else:
        schema = {"type": ["string", "number"], "maxLength": _MAX_TEXT}
    if optional:
        if "enum" in schema:
            schema["enum"].append(None)
        else:
            schema["type"] = [*([schema["type"]] if isinstance(schema["type"], str) else schema["type"]), "null"]
    return schema


def _scalar_text(value: Any, where: str) -> str:
    """A text key's value: a string or number (never a container — ``str()`` of a YAML alias tree
    grows exponentially — nor a YAML boolean, which is a value someone forgot to quote), printable,
    at most ``_MAX_TEXT`` characters."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected text, got {str(value).lower()} (quote it if it is meant as text)")
    if not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: expected text, got a {type(value).__name__}")
    text = value if isinstance(value, str) else str(value)
    if len(text) > _MAX_TEXT:
        raise ConfigError(f"{where}: text of {len(text)} characters is over {_MAX_TEXT}")
    if any(ord(c) < 0x20 and c != "\t" for c in text):
        raise ConfigError(f"{where}: control character in {text[:40]!r}")
    return text


def split_address(text: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port``) as (host, port) — host "" for every interface — or None when it is not one."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65_535 or any(c.isspace() for c in host):
        return None
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")) or len(host) < 3:
            return None
        host = host[1:-1]
    elif ":" in host:
        return None  # an IPv6 address takes brackets: [::1]:9500
    return host, int(port)


def _address(text: str, kind: str, where: str) -> str:
    if kind == "listen_or_off" and text.strip().lower() in _METRICS_OFF:
        return text
    if kind == "target" and ("://" in text or text.startswith("unix:")):
        return text
    parts = split_address(text)
    if parts is None or (kind == "target" and (not parts[0] or parts[1] == 0)):
        shape = "host:port (a port from 1 to 65535)" if kind == "target" else "host:port (a port from 0 to 65535)"
        off = " or off" if kind == "listen_or_off" else ""
        raise ConfigError(f"{where}: {text[:80]!r} is not {shape}{off}")
    return text


def _number(value: Any, where: str, *, integer: bool) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{where}: expected {'an integer' if integer else 'a number'}, got {value!r:.60}")
    try:
        number = float(value) if not isinstance(value, int) else value
    except ValueError:
        raise ConfigError(f"{where}: expected {'an integer' if integer else 'a number'}, got {value!r:.60}") from None
    if isinstance(number, float) and not math.isfinite(number):
        raise ConfigError(f"{where}: must be a finite number, got {value!r:.60}")
    if integer:
        if isinstance(number, float):
            if not number.is_integer():
                raise ConfigError(f"{where}: expected an integer, got {value!r:.60}")
            number = int(number)
        return int(number)
    return float(number)


def _in_range(number: float, name: str, where: str) -> None:
    bounds = _RANGES.get(name)
    if bounds is None:
        return
    low, high = bounds
    above = name in _ABOVE
    if number > high or number < low or (above and number == low):
        side = f"> {_shown(low)}" if above else f">= {_shown(low)}"
        raise ConfigError(f"{where}: must be {side} and <= {_shown(high)}, got {_shown(number)}")


def _shown(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _coerce(value: Any, hint: Any, where: str, name: str = "") -> Any:
    """``value`` as the type ``hint`` names, checked: one ConfigError line naming ``where`` otherwise."""
    text = str(hint)
    if value is None:
        if "None" in text:
            return None
        raise ConfigError(f"{where}: may not be empty")
    if hint is bool or text == "bool":
        if isinstance(value, bool):
            return value
        low = str(value).strip().lower() if isinstance(value, (str, int)) else ""
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r:.60}")
    if hint is float or text.startswith("float"):
        number = _number(value, where, integer=False)
        _in_range(number, name, where)
        return number
    if hint is int or text.startswith("int"):
        number = _number(value, where, integer=True)
        _in_range(number, name, where)
        return number
    if text.startswith("list"):
        if isinstance(value, str):
            items: list[Any] = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, list):
            items = value
        else:
            raise ConfigError(f"{where}: expected a list, got {value!r:.60}")
        if len(items) > _MAX_LIST:
            raise ConfigError(f"{where}: {len(items)} items is over {_MAX_LIST}")
        return [_scalar_text(v, f"{where}[{i}]") for i, v in enumerate(items)]
    text = _scalar_text(value, where)
    if name in _ADDRESSES and not (text == "" and "None" in str(hint)):
        return _address(text, _ADDRESSES[name], where)
    if name in _CHOICES and text not in _CHOICES[name]:
        # YAML reads an unquoted 4.10 as the number 4.1: say so rather than only that 4.1 is no choice
        quote = " (quote it: YAML reads 4.10 as the number 4.1)" if isinstance(value, float) else ""
        raise ConfigError(f"{where}: {text[:40]!r} is not one of {', '.join(_CHOICES[name])}{quote}")
    return text


def _apply(cfg: Config, data: Mapping[str, Any], source: str, *, env: bool = False) -> None:
    """Set each key of ``data`` (``{section: {key: value}}``) on ``cfg``; ``env``: the values came
    from ``GPUHEALTH_<SECTION>_<KEY>`` variables, and errors name the variable."""
    for section_name, values in data.items():
        section = getattr(cfg, str(section_name), None) if isinstance(section_name, str) else None
        if section is None or not dataclasses.is_dataclass(section):
            raise ConfigError(f"{source}: unknown section {str(section_name)[:60]!r}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: section '{section_name}' must be a mapping")
        hints = get_type_hints(type(section))
        for key, value in values.items():
            if not isinstance(key, str) or key not in hints:
                raise ConfigError(f"{source}: unknown key '{section_name}.{str(key)[:60]}'")
            name = f"{section_name}.{key}"
            where = f"{source} {_env_var(section_name, key)} ({name})" if env else f"{source}: {name}"
            setattr(section, key, _coerce(value, hints[key], where, name))


def _env_var(section: str, key: str) -> str:
    return f"GPUHEALTH_{section.upper()}_{key.upper()}"


def _read_file(p: Path) -> Any:
    """The YAML document in ``p``: one ConfigError line for a file that cannot be read, is not
    UTF-8, is too large or is not YAML."""
    try:
        with p.open("rb") as fh:
            raw = fh.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) > _MAX_FILE_BYTES:
        raise ConfigError(f"{p}: over {_MAX_FILE_BYTES} bytes; a config file is a page of YAML")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"{p}: not valid YAML{at}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{p}: not valid YAML: nested too deeply") from None


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
        data = _read_file(p)
        if not isinstance(data, Mapping):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        _apply(cfg, data, str(p))
    env = os.environ if env is None else env
    from_env: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        for key in get_type_hints(type(section)):
            var = _env_var(f.name, key)
            if var in env:
                from_env.setdefault(f.name, {})[key] = env[var]
    _apply(cfg, from_env, "environment", env=True)
    if overrides:
        for section, values in overrides.items():
            for key, value in values.items():
                if value is None:
                    continue
                try:
                    _apply(cfg, {section: {key: value}}, "flags")
                except ConfigError as exc:
                    raise FlagError(str(exc), f"{section}.{key}") from None
    return cfg


__all__ = ["AgentConfig", "CollectorsConfig", "Config", "ConfigError", "CoordinatorConfig", "DiagConfig", "FlagError",
           "json_schema", "load_config", "split_address"]
