"""The XID catalog holds NVIDIA's whole catalog, and gpuhealth's judgement of each code is either derived
from NVIDIA's resolution buckets by one documented mapping or a deliberate, pinned departure from it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gpuhealth.catalog.xid import (
    CatalogError,
    Judgement,
    bucket_judgement,
    catalog_version,
    load_xid_catalog,
    xid_info,
)
from gpuhealth.model import Action, Severity

REPO = Path(__file__).resolve().parents[3]
HEADER = "code,mnemonic,name,resolution,investigatory,severity,action,repeat_action,hardware,source\n"
C, W, N = Severity.CRITICAL, Severity.WARNING, Severity.INFO
A = Action


def test_the_table_holds_every_code_of_nvidias_catalog_with_description_resolution_and_action() -> None:
    catalog = load_xid_catalog()
    assert len(catalog) >= 172 and set(range(1, 173)) <= set(catalog)
    for code, info in catalog.items():
        assert info.code == code and info.known
        assert info.name and info.mnemonic and info.resolution and info.investigatory and info.source, code
        assert isinstance(info.action, Action) and isinstance(info.severity, Severity), code
    # NVIDIA's facts for a few codes, as the catalog publishes them
    assert (catalog[79].mnemonic, catalog[79].resolution) == ("ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "RESTART_BM")
    assert (catalog[54].resolution, catalog[145].resolution) == ("CHECK_MECHANICALS", "WORKFLOW_NVLINK5_ERR")
    assert catalog[172].mnemonic == "UNCORRECTABLE_SRAM_ERROR" and catalog[172].resolution == "unpublished"


def test_the_csv_says_which_edition_of_nvidias_catalog_it_reflects() -> None:
    text = (REPO / "src" / "gpuhealth" / "catalog" / "xid.csv").read_text()
    assert "# version: NVIDIA Xid Catalog, 172 codes" in text
    assert "172 codes" in catalog_version() and "2025-10-29" in catalog_version()


@pytest.mark.parametrize(("immediate", "investigatory", "expected"), [
    ("RESET_GPU", "CONTACT_SUPPORT", Judgement(C, A.RESET_GPU, A.DRAIN, True)),
    ("RESTART_BM", "CONTACT_SUPPORT", Judgement(C, A.REBOOT, A.DRAIN, True)),
    ("RESTART_VM", "CONTACT_SUPPORT", Judgement(W, A.REBOOT, A.DRAIN, True)),
    ("CHECK_MECHANICALS", "CONTACT_SUPPORT", Judgement(C, A.DRAIN, A.DRAIN, True)),
    ("RESTART_APP", "CHECK_APP/CUDA", Judgement(N, A.CHECK_JOB, A.CHECK_JOB, False)),
    ("RESTART_APP", "WORKFLOW_XID_13", Judgement(N, A.CHECK_JOB, A.CHECK_JOB, False)),
    ("RESTART_APP", "CONTACT_SUPPORT", Judgement(W, A.CHECK_JOB, A.RESET_GPU, True)),
    ("IGNORE", "IGNORE", Judgement(N, A.NONE, A.NONE, True)),
    ("IGNORE", "XID_137_FLOW", Judgement(N, A.CHECK_JOB, A.CHECK_JOB, False)),
    ("IGNORE", "CONTACT_SUPPORT", Judgement(W, A.MONITOR, A.RESET_GPU, True)),
    ("CONTACT_SUPPORT", "N/A", Judgement(W, A.MONITOR, A.RESET_GPU, True)),
    ("UPDATE_SWFW", "UPDATE_SWFW", Judgement(W, A.MONITOR, A.RESET_GPU, True)),
    ("CHECK_UVM", "SYMPATHETIC_REPORT_SOLO", Judgement(W, A.MONITOR, A.RESET_GPU, True)),
    ("WORKFLOW_XID_48", "WORKFLOW_XID_48", None),
    ("XID_154", "N/A (about another XID)", None),
    ("unpublished", "unpublished", None),
])
def test_nvidias_buckets_map_onto_gpuhealths_actions(immediate: str, investigatory: str,
                                                      expected: Judgement | None) -> None:
    assert bucket_judgement(immediate, investigatory) == expected


def test_rows_without_a_judgement_take_it_from_the_buckets() -> None:
    derived = [i for i in load_xid_catalog().values() if i.from_buckets]
    assert len(derived) >= 100  # every code the old 57-row table did not have, but 162-172
    for info in derived:
        assert Judgement(info.severity, info.action, info.repeat_action, info.hardware) == bucket_judgement(
            info.resolution, info.investigatory), info.code
    catalog = load_xid_catalog()
    assert (catalog[136].severity, catalog[136].action) == (C, A.RESET_GPU)  # NVLink training failed: RESET_GPU
    assert (catalog[39].severity, catalog[39].action, catalog[39].hardware) == (W, A.CHECK_JOB, True)  # copy engine
    assert (catalog[25].action, catalog[25].hardware) == (A.CHECK_JOB, False)  # illegal push buffer: the app's
    assert (catalog[106].severity, catalog[106].action) == (N, A.NONE)  # SMBPBI test message


# Where gpuhealth's own call departs from its reading of NVIDIA's buckets, on purpose (docs/xid.md, "basis"):
# stricter on engine and firmware faults NVIDIA's catalog says to ignore (38, 44, 157) or to restart the app
# for (32, 69, 94), rma as the repeat of memory errors (63, 64, 95, 140, 143, 156), application XIDs after
# k8s-device-plugin (43, 68), codes NVIDIA marks unused on Ampere+ judged for older GPUs (57, 58, 61, 123), and
# an InfoROM wear warning that does not escalate to a reset (93).
DEPARTURES = {32, 38, 43, 44, 57, 58, 61, 63, 64, 68, 69, 93, 94, 95, 123, 140, 143, 156, 157}


def test_departures_from_the_buckets_are_the_deliberate_ones() -> None:
    departing = set()
    for code, info in load_xid_catalog().items():
        mapped = bucket_judgement(info.resolution, info.investigatory)
        if mapped is not None and mapped != Judgement(info.severity, info.action, info.repeat_action, info.hardware):
            departing.add(code)
    assert departing == DEPARTURES


def test_codes_nvidias_catalog_contradicted_follow_it_now() -> None:
    catalog = load_xid_catalog()
    assert (catalog[109].severity, catalog[109].action, catalog[109].hardware) == (C, A.RESET_GPU, True)
    assert (catalog[121].severity, catalog[121].action) == (W, A.MONITOR)  # corrected C2C errors
    assert (catalog[151].severity, catalog[151].action) == (W, A.REBOOT)  # RESTART_VM
    assert (catalog[171].severity, catalog[171].action, catalog[171].repeat_action) == (C, A.RESET_GPU, A.RMA)


def test_an_unknown_code_is_a_warning_that_names_the_catalog_edition() -> None:
    info = xid_info(250)
    assert not info.known and (info.severity, info.action, info.repeat_action) == (W, A.MONITOR, A.RESET_GPU)
    assert "not in NVIDIA's Xid catalog" in info.name and "2025-10-29" in info.name


@pytest.mark.parametrize(("row", "why"), [
    ("79,M,x,RESTART_BM,CONTACT_SUPPORT,critical,reboot,,,me", "all of them or none"),
    ("48,M,x,WORKFLOW_XID_48,WORKFLOW_XID_48,,,,,me", "needs severity, action"),
    ("48,M,x,,CONTACT_SUPPORT,,,,,me", "must not be empty"),
    ("48,M,x,RESET_GPU,CONTACT_SUPPORT,fatal,reset_gpu,drain,yes,me", "FATAL"),
])
def test_a_malformed_row_is_one_clear_error(tmp_path: Path, row: str, why: str) -> None:
    bad = tmp_path / "xid.csv"
    bad.write_text(HEADER + row + "\n")
    with pytest.raises(CatalogError, match=rf"xid\.csv: data row 1: .*{why}"):
        load_xid_catalog(bad)


def test_the_xid_doc_is_generated_from_the_catalog() -> None:
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    expected = gen.render_xid()
    assert (REPO / "docs" / "xid.md").read_text() == expected, "docs/xid.md is out of date: run scripts/gen_docs.py"
    for code, info in load_xid_catalog().items():
        assert f"\n| {code} | `{info.mnemonic}` |" in expected
    assert "](xid.md)" in (REPO / "docs" / "findings.md").read_text()
    assert "](xid.md)" in (REPO / "docs" / "architecture.md").read_text()
