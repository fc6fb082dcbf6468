"""The XID catalog: what each NVIDIA XID code means, how bad it is and what to do about it.

The data lives in ``xid.csv`` beside this file (sources named per row). Codes not in the file get
a conservative default (warning, monitor) so a new driver's XID is still reported, never dropped.
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

_COLUMNS = ("code", "name", "severity", "action", "repeat_action", "hardware", "source")


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


def _parse(text: str, where: str) -> dict[int, XidInfo]:
    rows = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(rows)))
    if tuple(reader.fieldnames or ()) != _COLUMNS:
        raise CatalogError(f"{where}: header must be {','.join(_COLUMNS)}, got {reader.fieldnames}")
    out: dict[int, XidInfo] = {}
    for n, row in enumerate(reader, start=2):
        try:
            code = int(row["code"])
            info = XidInfo(
                code=code,
                name=row["name"].strip(),
                severity=Severity.parse(row["severity"]),
                action=Action.parse(row["action"]),
                repeat_action=Action.parse(row["repeat_action"]),
                hardware={"yes": True, "no": False}[row["hardware"].strip().lower()],
                source=row["source"].strip(),
            )
        except (KeyError, ValueError, AttributeError) as exc:
            raise CatalogError(f"{where}: data row {n - 1}: {exc!r} in {dict(row)}") from exc
        if code in out:
            raise CatalogError(f"{where}: data row {n - 1}: XID {code} listed twice")
        out[code] = info
    return out


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


@functools.cache
def _bundled() -> Mapping[int, XidInfo]:
    ref = resources.files("gpuhealth.catalog") / "xid.csv"
    return _parse(ref.read_text(), "gpuhealth/catalog/xid.csv")


def xid_info(code: int, catalog: Mapping[int, XidInfo] | None = None) -> XidInfo:
    """Catalog entry for ``code``; an unknown code gets a warning/monitor default (reset if it repeats)."""
    cat = _bundled() if catalog is None else catalog
    info = cat.get(code)
    if info is not None:
        return info
    return XidInfo(
        code=code,
        name=f"XID {code} (not in the catalog; see NVIDIA's Xid catalog)",
        severity=Severity.WARNING,
        action=Action.MONITOR,
        repeat_action=Action.RESET_GPU,
        hardware=True,
        source="gpuhealth default for unknown XIDs",
        known=False,
    )


__all__ = ["CatalogError", "XidInfo", "load_xid_catalog", "xid_info"]
