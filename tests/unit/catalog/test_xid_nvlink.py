"""NVLink XIDs 144-150 decoded from their kernel line by NVIDIA's decode table. The lines are shaped as the
driver logs them (GB200 lines published in public bug reports), not made up: unit, Fatal/Nonfatal, XC/i,
Link n, then the hex words."""

from __future__ import annotations

import pytest

from gpuhealth.catalog.xid_nvlink import NVLINK_XIDS, decode_nvlink, nvlink_rules
from gpuhealth.model import Action, Severity

C, W, N = Severity.CRITICAL, Severity.WARNING, Severity.INFO


@pytest.mark.parametrize(("xid", "message", "unit", "link", "status", "judged", "investigate"), [
    (144, "SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008 0x00000000 0x00000000 0x00000000 0x00000000)",
     "SAW_MVB", 0, 0x8, (W, Action.MONITOR), "CONTACT_SUPPORT"),
    (145, "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)",
     "RLW_RXPIPE", 13, 0x8, (W, Action.MONITOR), "CONTACT_SUPPORT"),
    (145, "RLW_REMAP Fatal XC0 i0 Link 05 (0x00000004 0x00000040 0x00000000 0x00000000)",
     "RLW_REMAP", 5, 0x40, (C, Action.RESET_GPU), "CONTACT_SUPPORT"),
    (145, "RLW_REMAP Nonfatal XC0 i0 Link 03 (0x00000004 0x00000100 0x00000000 0x00000000)",
     "RLW_REMAP", 3, 0x100, (N, Action.NONE), "IGNORE"),
    (145, "RLW_REMAP Nonfatal XC0 i0 Link 01 (0x00000004 0x00000002 0x00000000 0x00000000)",
     "RLW_REMAP", 1, 0x2, (W, Action.MONITOR), "CONTACT_SUPPORT"),  # XID_154_EVAL: the 154 says what to do
    # NETIR_LINK_EVT: the link-down reason is bits 20-25 of the first word (0x25 = 37: the peer's fault)
    (149, "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
     "NETIR_LINK_EVT", 0, 0x0, (C, Action.RESET_GPU), "INVESTIGATE_PEER_DEVICE"),
    (149, "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x026001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
     "NETIR_LINK_EVT", 0, 0x0, (W, Action.MONITOR), "INVESTIGATE_SW/USER"),
    (149, "NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
     "NETIR", None, 0x0, (C, Action.RESET_GPU), "SYMPATHETIC_REPORT_SOLO"),
    (150, "MSE_WATCHDOG Fatal XC0 i0 Link -1 (0x00000000 0x00000000)", "MSE_WATCHDOG", None, 0x0,
     (C, Action.RESET_GPU), "CONTACT_SUPPORT"),
])
def test_a_documented_line_is_judged_by_nvidias_row(xid: int, message: str, unit: str, link: int | None,
                                                     status: int, judged: tuple[Severity, Action],
                                                     investigate: str) -> None:
    decoded = decode_nvlink(xid, message)
    assert decoded is not None and decoded.rule is not None
    assert (decoded.unit, decoded.link, decoded.error_status) == (unit, link, status)
    assert decoded.judgement() == judged and decoded.rule.investigatory == investigate
    ev = decoded.evidence()
    assert ev["documented"] is True and ev["error_status"] == f"0x{status:08x}" and ev["link"] == link
    assert f"error status 0x{status:08x}" in decoded.summary()


def test_the_drivers_word_is_kept_and_the_link_down_reason_decoded() -> None:
    decoded = decode_nvlink(149, "NETIR_LINK_EVT Fatal XC0 i0 Link 07 (0x025001c6 0x00000000)")
    assert decoded is not None and decoded.fatal and decoded.intr_code == 37 and decoded.intr_info == 0x025001C6


def test_several_bits_take_the_worst_documented_one() -> None:
    decoded = decode_nvlink(144, "SAW_MVB Nonfatal XC0 i0 Link 2 (0x00000001 0x0000000c 0x0)")  # 0x4 | 0x8
    assert decoded is not None and decoded.rule is not None and decoded.rule.error_status == 0x8
    assert decoded.judgement() == (W, Action.MONITOR)


def test_what_nvidia_does_not_document_keeps_the_raw_words_and_no_judgement() -> None:
    decoded = decode_nvlink(145, "RLW_REMAP Nonfatal XC0 i0 Link 4 (0x00000004 0x00001000 0x00000007)")
    assert decoded is not None and decoded.rule is None and decoded.judgement() is None
    assert decoded.evidence()["words"] == ["0x00000004", "0x00001000", "0x00000007"]
    assert "not in NVIDIA's decode table" in decoded.summary()
    assert decode_nvlink(145, "BRAND_NEW_UNIT Fatal XC0 i0 Link 1 (0x1 0x2)").rule is None  # type: ignore[union-attr]


def test_other_codes_and_other_shapes_are_not_decoded() -> None:
    assert decode_nvlink(74, "SAW_MVB Nonfatal XC0 i0 Link 0 (0x1 0x8)") is None
    assert decode_nvlink(145, "pid=1, name=x, something else") is None
    assert decode_nvlink(145, "") is None


def test_the_table_covers_every_nvlink5_code() -> None:
    rules = nvlink_rules()
    assert {r.xid for r in rules} == set(NVLINK_XIDS)
    assert {r.resolution for r in rules} == {"RESET_GPU", "IGNORE", "XID_154_EVAL"}
    assert len({(r.xid, r.unit, r.error_status, r.intr_code) for r in rules}) == len(rules)
