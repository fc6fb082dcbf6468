"""The XID catalog: what each NVIDIA XID code means, how bad it is and what to do about it.

The data lives in ``xid.csv`` beside this file: every code of NVIDIA's Xid catalog with NVIDIA's mnemonic
and resolution buckets (immediate and investigatory action), our description, and gpuhealth's judgement
(severity, action, repeat_action, hardware). A row that leaves the judgement empty takes it from NVIDIA's
buckets (``bucket_judgement``: the documented mapping, docs/xid.md); a row that fills it is gpuhealth's own
call, its source named. Codes not in the file get a conservative default (warning, monitor) so a new
driver's XID is still reported, never dropped.
"""

from __future__ import annotations

import csv
import functools
import io
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gpuhealth.model import Action, Severity

_COLUMNS = ("code", "mnemonic", "name", "resolution", "investigatory", "severity", "action", "repeat_action",
            "hardware", "source")
_JUDGEMENT = ("severity", "action", "repeat_action", "hardware")
_VERSION = "# version:"
UNPUBLISHED = "unpublished"  # NVIDIA's catalog gives the code no bucket (162-172 in the 2025-10-29 edition)
# Investigatory buckets that point at the application (its code, CUDA, its NVLink peer access), not the GPU.
APPLICATION_SIDE = frozenset({"CHECK_APP/CUDA", "WORKFLOW_XID_13", "WORKFLOW_XID_31", "XID_137_FLOW"})


class CatalogError(ValueError):
    """The catalog file is malformed; the message names the file, the line and the column."""


@dataclass(frozen=True, slots=True)
class XidInfo:
    code: int
    name: str
    severity: Severity
    action: Action
    repeat_action: Action  # when the XID returns on the same GPU after a reset
    hardware: bool  # False: the application caused it; the GPU itself is fine
    source: str
    known: bool = True
    mnemonic: str = ""
    resolution: str = ""  # NVIDIA's immediate-action bucket (RESET_GPU, RESTART_APP, …)
    investigatory: str = ""  # NVIDIA's investigatory-action bucket
    from_buckets: bool = False  # the judgement is bucket_judgement's, not a gpuhealth call


@dataclass(frozen=True, slots=True)
class Judgement:
    severity: Severity
    action: Action
    repeat_action: Action
    hardware: bool


_RESET = Judgement(Severity.CRITICAL, Action.RESET_GPU, Action.DRAIN, True)
_WATCH = Judgement(Severity.WARNING, Action.MONITOR, Action.RESET_GPU, True)  # also the unknown-code default
_APPLICATION = Judgement(Severity.INFO, Action.CHECK_JOB, Action.CHECK_JOB, False)


def bucket_judgement(resolution: str, investigatory: str) -> Judgement | None:
    """gpuhealth's reading of NVIDIA's buckets, None where they need a per-code call (WORKFLOW_*, XID_154,
    unpublished). The immediate bucket decides; the investigatory one tells the application's fault from a
    GPU worth watching."""
    immediate, later = resolution.strip().upper(), investigatory.strip().upper()
    if immediate == "RESET_GPU":
        return _RESET
    if immediate == "RESTART_BM":  # restart the bare-metal node
        return Judgement(Severity.CRITICAL, Action.REBOOT, Action.DRAIN, True)
    if immediate == "RESTART_VM":  # restart the VM: the node, as this agent sees it
        return Judgement(Severity.WARNING, Action.REBOOT, Action.DRAIN, True)
    if immediate == "CHECK_MECHANICALS":  # someone has to look at the board: no jobs meanwhile
        return Judgement(Severity.CRITICAL, Action.DRAIN, Action.DRAIN, True)
    if immediate == "RESTART_APP":
        if later in APPLICATION_SIDE:
            return _APPLICATION
        return Judgement(Severity.WARNING, Action.CHECK_JOB, Action.RESET_GPU, True)
    if immediate == "IGNORE":
        if later == "IGNORE":
            return Judgement(Severity.INFO, Action.NONE, Action.NONE, True)
        return _APPLICATION if later in APPLICATION_SIDE else _WATCH
    if immediate in ("CONTACT_SUPPORT", "UPDATE_SWFW", "CHECK_UVM"):
        return _WATCH
    return None


def _parse(text: str, where: str) -> dict[int, XidInfo]:
    rows = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(rows)))
    if tuple(reader.fieldnames or ()) != _COLUMNS:
        raise CatalogError(f"{where}: header must be {','.join(_COLUMNS)}, got {reader.fieldnames}")
    out: dict[int, XidInfo] = {}
    for n, row in enumerate(reader, start=2):
        try:
            code = int(row["code"])
            info = _row(code, row)
        except (KeyError, ValueError, AttributeError) as exc:
            raise CatalogError(f"{where}: data row {n - 1}: {exc!r} in {dict(row)}") from exc
        if code in out:
            raise CatalogError(f"{where}: data row {n - 1}: XID {code} listed twice")
        out[code] = info
    return out


def _row(code: int, row: Mapping[str, str]) -> XidInfo:
    name, resolution, investigatory = row["name"].strip(), row["resolution"].strip(), row["investigatory"].strip()
    if not (name and resolution and investigatory):
        raise ValueError("name, resolution and investigatory must not be empty")
    given = [row[c].strip() for c in _JUDGEMENT]
    if any(given) and not all(given):
        raise ValueError(f"{', '.join(_JUDGEMENT)}: all of them or none (none: from NVIDIA's buckets)")
    if all(given):
        judged = Judgement(Severity.parse(given[0]), Action.parse(given[1]), Action.parse(given[2]),
                           {"yes": True, "no": False}[given[3].lower()])
    else:
        derived = bucket_judgement(resolution, investigatory)
        if derived is None:
            raise ValueError(f"bucket {resolution}/{investigatory} needs severity, action, repeat_action, hardware")
        judged = derived
    return XidInfo(code=code, name=name, severity=judged.severity, action=judged.action,
                   repeat_action=judged.repeat_action, hardware=judged.hardware, source=row["source"].strip(),
                   mnemonic=row["mnemonic"].strip(), resolution=resolution, investigatory=investigatory,
                   from_buckets=not any(given))


def load_xid_catalog(path: str | Path | None = None) -> Mapping[int, XidInfo]:
    """Parse a catalog file (the bundled ``xid.csv`` when ``path`` is None)."""
    if path is None:
        return _bundled()
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise CatalogError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    return _parse(text, str(p))


def _bundled_text() -> str:
    return (resources.files("gpuhealth.catalog") / "xid.csv").read_text()


@functools.cache
def _bundled() -> Mapping[int, XidInfo]:
    return _parse(_bundled_text(), "gpuhealth/catalog/xid.csv")


@functools.cache
def catalog_version() -> str:
    """Which edition of NVIDIA's catalog the bundled file reflects (its ``# version:`` line)."""
    for line in _bundled_text().splitlines():
        if line.startswith(_VERSION):
            return line[len(_VERSION):].strip()
    return "unknown edition"


def xid_info(code: int, catalog: Mapping[int, XidInfo] | None = None) -> XidInfo:
    """Catalog entry for ``code``; an unknown code gets a warning/monitor default (reset if it repeats)."""
    cat = _bundled() if catalog is None else catalog
    info = cat.get(code)
    if info is not None:
        return info
    return XidInfo(
        code=code,
        name=f"not in NVIDIA's Xid catalog as gpuhealth knows it ({catalog_version()})",
        severity=_WATCH.severity,
        action=_WATCH.action,
        repeat_action=_WATCH.repeat_action,
        hardware=_WATCH.hardware,
        source="gpuhealth default for unknown XIDs",
        known=False,
    )


__all__ = ["APPLICATION_SIDE", "UNPUBLISHED", "CatalogError", "Judgement", "XidInfo", "bucket_judgement",
           "catalog_version", "load_xid_catalog", "xid_info"]
