"""The finding-code catalog: every code gpuhealth emits, what it means and what to do about it.

The data lives in ``findings.csv`` beside this file, one row per code (adding a code is adding a
row); ``docs/findings.md`` is generated from it (``python scripts/gen_docs.py``) and
``tests/unit/catalog/test_catalogs.py`` checks it against the codes the source emits, both ways.
"""

from __future__ import annotations

import csv
import functools
import io
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

from gpuhealth.catalog.xid import CatalogError
from gpuhealth.model import Action, Severity

_COLUMNS = ("code", "severity", "action", "emitted_by", "meaning", "what_to_do")
PER_XID_CATALOG = "per xid.csv"
XID_FAMILY = "xid.<n>"


@dataclass(frozen=True, slots=True)
class CodeInfo:
    code: str  # "ecc.dbe_volatile"; "xid.<n>" stands for every XID
    severities: tuple[Severity, ...]  # the severities it is emitted with
    actions: tuple[Action, ...]
    emitted_by: tuple[str, ...]  # files under src/gpuhealth/
    meaning: str
    what_to_do: str
    per_xid_catalog: bool = False  # severity and action come from catalog/xid.csv

    def matches(self, code: str) -> bool:
        if self.code == XID_FAMILY:
            return code.startswith("xid.") and code[4:].isdigit()
        return code == self.code


def _parse_list(text: str, parse: type[Severity] | type[Action]) -> tuple[tuple[Severity | Action, ...], bool]:
    if text.strip() == PER_XID_CATALOG:
        return tuple(parse), True
    return tuple(parse.parse(part) for part in text.split("|")), False


def parse_codes(text: str, where: str) -> dict[str, CodeInfo]:
    rows = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(rows)))
    if tuple(reader.fieldnames or ()) != _COLUMNS:
        raise CatalogError(f"{where}: header must be {','.join(_COLUMNS)}, got {reader.fieldnames}")
    out: dict[str, CodeInfo] = {}
    for n, row in enumerate(reader, start=1):
        try:
            severities, per_xid = _parse_list(row["severity"], Severity)
            actions, _ = _parse_list(row["action"], Action)
            info = CodeInfo(
                code=row["code"].strip(), severities=severities, actions=actions,  # type: ignore[arg-type]
                emitted_by=tuple(row["emitted_by"].split()), meaning=row["meaning"].strip(),
                what_to_do=row["what_to_do"].strip(), per_xid_catalog=per_xid,
            )
        except (KeyError, AttributeError) as exc:
            raise CatalogError(f"{where}: data row {n}: {exc!r} in {dict(row)}") from exc
        if info.code in out:
            raise CatalogError(f"{where}: data row {n}: code {info.code} listed twice")
        if not (info.code and info.emitted_by and info.meaning and info.what_to_do):
            raise CatalogError(f"{where}: data row {n}: every column needs a value: {dict(row)}")
        out[info.code] = info
    return out


@functools.cache
def finding_codes() -> Mapping[str, CodeInfo]:
    """The bundled catalog, parsed once, by code."""
    text = (resources.files("gpuhealth.catalog") / "findings.csv").read_text()
    return parse_codes(text, "gpuhealth/catalog/findings.csv")


def code_info(code: str) -> CodeInfo | None:
    """The catalog entry for ``code`` (``xid.79`` → the ``xid.<n>`` family), or None."""
    codes = finding_codes()
    if code in codes:
        return codes[code]
    family = codes.get(XID_FAMILY)
    return family if family is not None and family.matches(code) else None


__all__ = ["CodeInfo", "code_info", "finding_codes", "parse_codes"]
