"""NVLink XIDs 144-150 decoded from their kernel line, by NVIDIA's decode table (``xid_nvlink.csv``).

One code (say 145, an RLW error) covers errors from harmless to fatal; the line says which::

    NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 ...)

``decode_nvlink`` reads the unit, the driver's Fatal/Nonfatal word, the link (-1: not one link) and the hex
words (interrupt info, error status, …), then looks up NVIDIA's row for that unit and error status (for
NETIR_LINK_EVT also the link-down reason, bits 20-25 of the interrupt info). An error status with several
bits set and no row of its own is judged by its worst documented bit. What is not in the table keeps the
catalog's judgement for the code; the raw words are kept either way.
"""

from __future__ import annotations

import csv
import functools
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from gpuhealth.catalog.xid import CatalogError
from gpuhealth.model import Action, Severity

NVLINK_XIDS = range(144, 151)
_COLUMNS = ("xid", "unit", "error_status", "intr_code", "nvidia_severity", "resolution", "investigatory", "origin")
# "<unit> <Fatal|Nonfatal> XC0 i0 Link <n> (0x… 0x… …)": only the unit, the word, the link and the words matter.
_LINE = re.compile(r"^(?P<unit>[A-Za-z0-9_/]+) (?P<word>Fatal|Non-?fatal)\b.*?\bLink (?P<link>-?\d+)\s*"
                   r"\((?P<words>\s*0x[0-9A-Fa-f]+(?:\s+0x[0-9A-Fa-f]+)*)\s*\)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class NvlinkRule:
    """One row of NVIDIA's decode sheet."""

    xid: int
    unit: str  # as NVIDIA writes it, e.g. "NETIR_LINK_EVT/NETIR_LINK_DOWN"
    error_status: int
    intr_code: int  # bits 20-25 of the interrupt info
    nvidia_severity: str  # Fatal, Link Fatal, Non-fatal
    resolution: str  # immediate bucket: RESET_GPU, IGNORE, XID_154_EVAL
    investigatory: str
    origin: str  # HW, SW, FW, HW/SW

    def names(self) -> set[str]:
        parts = self.unit.upper().split("/")
        return {self.unit.upper(), *parts}


@dataclass(frozen=True, slots=True)
class NvlinkDecode:
    """What one 144-150 kernel line says, and NVIDIA's row for it (None: not in the table)."""

    xid: int
    unit: str
    fatal: bool  # the driver's own word
    link: int | None  # None: the error is not one link's (the driver prints -1)
    words: tuple[int, ...]
    rule: NvlinkRule | None

    @property
    def intr_info(self) -> int:
        return self.words[0]

    @property
    def error_status(self) -> int:
        return self.words[1] if len(self.words) > 1 else 0

    @property
    def intr_code(self) -> int:
        return (self.intr_info >> 20) & 0x3F

    def judgement(self) -> tuple[Severity, Action] | None:
        """gpuhealth's reading of NVIDIA's row; None keeps the catalog's judgement for the code."""
        return None if self.rule is None else _judge(self.rule)

    def evidence(self) -> dict[str, object]:
        out: dict[str, object] = {
            "unit": self.unit, "driver_says": "fatal" if self.fatal else "non-fatal", "link": self.link,
            "intr_info": f"0x{self.intr_info:08x}", "error_status": f"0x{self.error_status:08x}",
            "intr_code": self.intr_code, "words": [f"0x{w:08x}" for w in self.words],
            "documented": self.rule is not None,
        }
        if self.rule is not None:
            out.update(nvidia_unit=self.rule.unit, nvidia_severity=self.rule.nvidia_severity,
                       resolution=self.rule.resolution, investigatory=self.rule.investigatory,
                       origin=self.rule.origin)
        return out

    def summary(self) -> str:
        where = f"link {self.link}" if self.link is not None else "no single link"
        text = f"NVLink {self.unit} on {where}, error status 0x{self.error_status:08x}"
        if self.rule is None:
            return text + " (not in NVIDIA's decode table: judged as the code)"
        text += f": NVIDIA {self.rule.nvidia_severity}, {self.rule.resolution}"
        if self.rule.resolution == "XID_154_EVAL":
            text += " (act on the XID 154 that names the recovery)"
        return text + f", investigate: {self.rule.investigatory}"


def _judge(rule: NvlinkRule) -> tuple[Severity, Action] | None:
    if rule.resolution == "RESET_GPU":
        return Severity.CRITICAL, Action.RESET_GPU
    if rule.resolution == "XID_154_EVAL":  # the driver says what it needs in an XID 154, judged on its own
        return Severity.WARNING, Action.MONITOR
    if rule.resolution == "IGNORE":
        return (Severity.INFO, Action.NONE) if rule.investigatory == "IGNORE" else (Severity.WARNING, Action.MONITOR)
    return None


def _parse(text: str, where: str) -> tuple[NvlinkRule, ...]:
    rows = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(rows)))
    if tuple(reader.fieldnames or ()) != _COLUMNS:
        raise CatalogError(f"{where}: header must be {','.join(_COLUMNS)}, got {reader.fieldnames}")
    out = []
    for n, row in enumerate(reader, start=1):
        try:
            rule = NvlinkRule(int(row["xid"]), row["unit"].strip(), int(row["error_status"], 16),
                              int(row["intr_code"]), row["nvidia_severity"].strip(), row["resolution"].strip(),
                              row["investigatory"].strip(), row["origin"].strip())
        except (KeyError, ValueError, AttributeError) as exc:
            raise CatalogError(f"{where}: data row {n}: {exc!r} in {dict(row)}") from exc
        if rule.xid not in NVLINK_XIDS or not rule.unit or not rule.resolution:
            raise CatalogError(f"{where}: data row {n}: XID 144-150 with a unit and a resolution expected")
        out.append(rule)
    return tuple(out)


@functools.cache
def nvlink_rules() -> tuple[NvlinkRule, ...]:
    ref = resources.files("gpuhealth.catalog") / "xid_nvlink.csv"
    return _parse(ref.read_text(), "gpuhealth/catalog/xid_nvlink.csv")


def _worst(rules: Sequence[NvlinkRule]) -> NvlinkRule | None:
    def rank(rule: NvlinkRule) -> tuple[int, int]:
        judged = _judge(rule)
        return (-1, -1) if judged is None else (int(judged[0]), int(judged[1]))
    return max(rules, key=rank, default=None)


def _lookup(xid: int, unit: str, status: int, intr_code: int) -> NvlinkRule | None:
    mine = [r for r in nvlink_rules() if r.xid == xid and unit.upper() in r.names()]
    if len({r.intr_code for r in mine}) > 1:  # the unit's rows differ by the interrupt info's code (link down)
        mine = [r for r in mine if r.intr_code == intr_code]
    exact = [r for r in mine if r.error_status == status]
    if exact:
        return _worst(exact)
    bits = [1 << b for b in range(32) if status >> b & 1]
    per_bit = [[r for r in mine if r.error_status == bit] for bit in bits]
    if len(bits) > 1 and all(per_bit):  # every bit set is documented: the worst of them
        return _worst([r for rows in per_bit for r in rows])
    return None


def decode_nvlink(xid: int, message: str) -> NvlinkDecode | None:
    """The NVLink fields of a 144-150 message (the text after ``<code>, ``); None when it is not one."""
    if xid not in NVLINK_XIDS:
        return None
    m = _LINE.search(message.strip())
    if m is None:
        return None
    words = tuple(int(w, 16) for w in m["words"].split())
    link = int(m["link"])
    unit = m["unit"]
    status = words[1] if len(words) > 1 else 0
    rule = _lookup(xid, unit, status, (words[0] >> 20) & 0x3F)
    return NvlinkDecode(xid, unit, m["word"].lower() == "fatal", None if link < 0 else link, words, rule)


__all__ = ["NVLINK_XIDS", "NvlinkDecode", "NvlinkRule", "decode_nvlink", "nvlink_rules"]
