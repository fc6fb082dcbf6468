"""The public surface, curated: what the public modules export (``__all__``), and help on every
command-line option.

A change to a public module's ``__all__`` is a change to what others may build on: it shows up here
as a diff to review, not as an accident (a helper imported for internal use leaking out, say).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import click
import pytest

import gpuhealth
from gpuhealth.cli.main import COMMANDS, cli

# The modules others build on, and exactly what each offers.
PUBLIC: dict[str, set[str]] = {
    "gpuhealth.model": {"COULD_NOT_CHECK", "MAX_RANKS", "Action", "Entity", "EntityKind", "Finding", "Health",
                        "MetricKind", "RankIdentity", "Sample", "Severity", "StepRecord", "could_not_check",
                        "health_of", "takes_node_out", "worst_action"},
    "gpuhealth.flightrec.verdict": {"VERDICTS", "RootCause", "RootKind", "TriageReport", "Verdict", "triage"},
    "gpuhealth.flightrec.report": {"Blocked", "RootCause", "RootKind", "TriageReport", "Verdict"},
    "gpuhealth.config": {"AgentConfig", "CollectorsConfig", "Config", "ConfigError", "CoordinatorConfig",
                         "DiagConfig", "FlagError", "json_schema", "load_config", "split_address"},
    "gpuhealth.node": {"AgentFacts", "GpuReport", "NodeReport", "assemble_report", "build_report", "collect_once",
                       "default_kmsg", "make_backend", "open_backend", "report_of_snapshot"},
    "gpuhealth.collectors.base": {"CollectContext", "CollectError", "Collector", "GpuIdentity", "History", "Lane",
                                  "Observations"},
    "gpuhealth.collectors.registry": {"COLLECTOR_MODULES", "UnknownCollector", "all_collectors"},
    "gpuhealth.collectors.runner": {"FAILED_CODE", "CollectorRun", "CollectorRunner", "CollectorStatus",
                                    "enumerate_gpus", "error_findings"},
    "gpuhealth.backends.environment": {"UNKNOWN", "Environment", "detect_environment", "environment_for"},
    "gpuhealth.backends.base": {"NVLINK_KEYS", "NVLINK_MAX_LINKS", "FieldResult", "NvmlBackend", "XidEvent"},
    "gpuhealth.backends.nvml_keys": {"ALL_KEYS", "ARGUMENT_KEYS", "SIMPLE_KEYS", "SLOW_KEYS", "STRUCT_KEYS",
                                     "nvml_const", "resolve_arguments"},
    "gpuhealth.exporters": {"CollectorStatus", "ExportSnapshot", "NodeFacts", "finding_on_gpu"},
    "gpuhealth.exporters.prometheus": {"OPENMETRICS_CONTENT_TYPE", "PREFIX", "TEXT_CONTENT_TYPE", "MetricsEndpoint",
                                       "SnapshotCollector", "build_families", "encode_text"},
    "gpuhealth.agent.view": {"AgentExtension", "AgentView", "FindingsListener", "GpuLabelProvider", "ReportsSamples"},
    "gpuhealth.agent.daemon": {"Agent", "config_problem"},
    "gpuhealth.catalog.findings": {"CodeInfo", "code_info", "finding_codes", "parse_codes"},
    "gpuhealth.catalog.metrics": {"FamilyInfo", "metric_families", "parse_families"},
    "gpuhealth.catalog.thresholds": {"EccThresholds", "EthernetThresholds", "HostThresholds", "InfinibandThresholds",
                                     "MemoryThresholds", "NvlinkThresholds", "PcieThresholds", "ThermalThresholds",
                                     "Thresholds",
                                     "ThresholdsError", "ThrottleThresholds", "default_thresholds", "load_thresholds",
                                     "parse_thresholds", "thresholds_from"},
    "gpuhealth.catalog.xid": {"APPLICATION_SIDE", "UNPUBLISHED", "CatalogError", "Judgement", "XidInfo",
                              "bucket_judgement", "catalog_version", "load_xid_catalog", "xid_info"},
    "gpuhealth.catalog.xid_nvlink": {"NVLINK_XIDS", "NvlinkDecode", "NvlinkRule", "decode_nvlink", "nvlink_rules"},
    "gpuhealth.runtime.sdnotify": {"SystemdNotifier"},
    "gpuhealth.runtime.tls": {"SecurityConfigError", "TlsFiles", "channel_credentials", "server_credentials",
                              "tls_files", "token_metadata"},
    "gpuhealth.runtime.logs": {"LOGGER_NAME", "JsonLinesFormatter", "TextFormatter", "setup_logging"},
    "gpuhealth.instrument": {"COLLECTIVES", "Tracker"},
}
OWNED_COMMANDS = sorted(COMMANDS)


def _modules_with_all() -> list[ModuleType]:
    out = []
    for info in pkgutil.walk_packages(gpuhealth.__path__, "gpuhealth."):
        if "_pb2" in info.name or info.name.startswith("gpuhealth.proto"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (torch, triton) that is not installed here
            continue
        if hasattr(module, "__all__"):
            out.append(module)
    return out


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_modules_export_exactly_their_curated_names(name: str) -> None:
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    assert set(module.__all__) == PUBLIC[name], (
        f"{name}.__all__ changed: added {sorted(set(module.__all__) - PUBLIC[name])}, "
        f"removed {sorted(PUBLIC[name] - set(module.__all__))} — if deliberate, update PUBLIC here")


def test_every_all_names_gpuhealths_own_things() -> None:
    """Every name resolves, none is private, and none is something imported from another library
    (``__all__ = ["Path", "command"]`` once exported pathlib's Path). Re-exports within gpuhealth
    (a package's ``__init__``, a facade over its parts) are deliberate and allowed."""
    wrong = []
    for module in _modules_with_all():
        for name in module.__all__:
            if not hasattr(module, name):
                wrong.append(f"{module.__name__}.{name}: no such name")
                continue
            if name.startswith("_"):
                wrong.append(f"{module.__name__}.{name}: private")
            obj = getattr(module, name)
            home = getattr(obj, "__module__", None) if inspect.isclass(obj) or inspect.isfunction(obj) else None
            if home is not None and home != "gpuhealth" and not home.startswith("gpuhealth."):
                wrong.append(f"{module.__name__}.{name}: {home}'s, not gpuhealth's")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", OWNED_COMMANDS)
def test_a_command_module_exports_its_command_only(name: str) -> None:
    module = importlib.import_module(COMMANDS[name][0])
    assert module.__all__ == ["command"]
    assert isinstance(module.command, click.Command)


def _walk(cmd: click.Command, path: str, ctx: click.Context) -> list[tuple[str, click.Command]]:
    out = [(path, cmd)]
    if isinstance(cmd, click.Group):
        for sub in cmd.list_commands(ctx):
            child = cmd.get_command(ctx, sub)
            assert child is not None, f"{path} {sub}: listed but cannot be loaded"
            out += _walk(child, f"{path} {sub}", ctx)
    return out


def test_every_command_and_option_has_help() -> None:
    ctx = click.Context(cli)
    missing = []
    commands = _walk(cli, "gpuhealth", ctx)
    assert len(commands) >= len(COMMANDS) + 4  # every command, and diag's subcommands
    for path, cmd in commands:
        if not (cmd.help or cmd.short_help):
            missing.append(f"{path}: the command has no help")
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden and not p.help:
                missing.append(f"{path} {'/'.join(p.opts)}")
    assert not missing, "give these a help text:\n  " + "\n  ".join(missing)
