"""ECC / row remapping / retired pages, on the real recordings and fault scenarios."""

from __future__ import annotations

import pytest
from collector_kit import Sweeper, by_code, inline, problems, recording, sample_values, scenario

from gpuhealth.collectors import ecc
from gpuhealth.model import Action, EntityKind, Severity


@pytest.mark.parametrize("rec", ["nvml_h200x2.json", "nvml_h100x1.json"])
def test_real_recordings_are_healthy_and_retired_pages_not_supported_is_normal(clock, rec):
    s = Sweeper(ecc.create(), recording(rec, clock), clock)
    assert problems(s.sweep()) == []
    assert problems(s.after(120)) == []
    obs = s.last_obs
    # Hopper answers "Not Supported" for retired pages: recorded as unsupported, never an error.
    assert (0, "RetiredPages_DBE") in obs.unsupported
    assert obs.errors == []
    assert obs.per_gpu[0]["remap"] == {"correctable": 0, "uncorrectable": 0, "pending": 0, "failed": 0}
    assert sample_values(s.last_samples, "gpu_ecc_errors", 0, type="uncorrected", scope="volatile") == [0.0]
    assert sample_values(s.last_samples, "gpu_row_remap_bank_availability", 0, level="max")[0] > 0


def test_dbe_volatile_is_critical_reset_on_that_gpu(clock):
    b = scenario("dbe_volatile.yaml", clock)
    f = Sweeper(ecc.create(), b, clock).sweep()
    (dbe,) = by_code(f, "ecc.dbe_volatile")
    assert dbe.severity is Severity.CRITICAL
    assert dbe.action is Action.RESET_GPU
    assert dbe.entity.kind is EntityKind.GPU
    assert dbe.entity.id == b.query(1, "UUID") and dbe.entity.gpu_index == 1
    assert dbe.evidence["uncorrected_volatile"] == 2
    assert all(x.entity.gpu_index == 1 for x in problems(f))


def test_row_remap_failed_is_critical_rma(clock):
    b = scenario("row_remap_failed.yaml", clock)
    f = Sweeper(ecc.create(), b, clock).sweep()
    (fail,) = by_code(f, "memory.row_remap_failed")
    assert (fail.severity, fail.action, fail.entity.gpu_index) == (Severity.CRITICAL, Action.RMA, 0)
    assert fail.evidence["uncorrectable"] == 3


def test_row_remap_pending_is_warning_reset(clock):
    b = scenario("row_remap_pending.yaml", clock)
    s = Sweeper(ecc.create(), b, clock)
    f = s.sweep()
    (pend,) = by_code(f, "memory.row_remap_pending")
    assert (pend.severity, pend.action, pend.entity.gpu_index) == (Severity.WARNING, Action.RESET_GPU, 1)
    assert by_code(f, "memory.row_remap_failed") == []
    assert sample_values(s.last_samples, "gpu_row_remap_pending", 1) == [1.0]
    assert sample_values(s.last_samples, "gpu_remapped_rows", 1, cause="uncorrectable") == [1.0]


def test_512_uncorrectable_remaps_warn_once_with_rma(clock):
    b = scenario("row_remap_spares_low.yaml", clock)
    f = Sweeper(ecc.create(), b, clock).sweep()
    (low,) = by_code(f, "memory.row_remap_spares_low")
    assert (low.severity, low.action, low.entity.gpu_index) == (Severity.WARNING, Action.RMA, 0)
    assert low.evidence["uncorrectable"] == 512
    # 511 stays below the limit; a bank with no spare left still warns on its own.
    b2 = inline(clock, {"0": {"RemappedRows": [0, 511, 0, 0]}})
    assert by_code(Sweeper(ecc.create(), b2, clock).sweep(), "memory.row_remap_spares_low") == []
    b3 = inline(clock, {"0": {"RowRemapperHistogram": {"max": 3000, "high": 0, "partial": 0, "low": 0, "none": 1}}})
    (bank,) = by_code(Sweeper(ecc.create(), b3, clock).sweep(), "memory.row_remap_spares_low")
    assert bank.evidence["histogram"]["none"] == 1


def test_sbe_rate_needs_a_minute_of_history_then_warns(clock):
    b = scenario("sbe_ramp.yaml", clock)
    s = Sweeper(ecc.create(), b, clock)
    assert by_code(s.sweep(), "ecc.sbe_rate") == []
    assert by_code(s.after(30), "ecc.sbe_rate") == []  # 30 s of history: not yet trusted
    (rate,) = by_code(s.after(30), "ecc.sbe_rate")
    assert (rate.severity, rate.action, rate.entity.gpu_index) == (Severity.WARNING, Action.MONITOR, 1)
    assert rate.evidence["per_minute"] == pytest.approx(60.0)
    assert rate.evidence["window_s"] == pytest.approx(60.0)


def test_slow_sbe_growth_below_budget_is_quiet(clock):
    b = inline(clock, {"1": {"TotalEccErrors_CORRECTED_VOLATILE": {"ramp": 0.1}}})  # 6/min < 10/min
    s = Sweeper(ecc.create(), b, clock)
    s.sweep()
    assert by_code(s.after(120), "ecc.sbe_rate") == []


def test_retired_pages_on_pre_ampere_gpus(clock):
    pages = list(range(0x1000, 0x1000 + 61))
    b = inline(clock, {"0": {"RetiredPages_SBE": pages[:40], "RetiredPages_DBE": pages[40:],
                             "RetiredPagesPendingStatus": 1}})
    f = Sweeper(ecc.create(), b, clock).sweep()
    ret = by_code(f, "memory.retired_pages")
    assert {(x.severity, x.action) for x in ret} == {(Severity.CRITICAL, Action.RMA),
                                                     (Severity.WARNING, Action.RESET_GPU)}
    assert ret[0].evidence["total"] == 61
    b2 = inline(clock, {"0": {"RetiredPages_SBE": [], "RetiredPages_DBE": list(range(16))}})
    (soft,) = by_code(Sweeper(ecc.create(), b2, clock).sweep(), "memory.retired_pages")
    assert soft.severity is Severity.WARNING and soft.evidence["dbe"] == 16


def test_a_failing_reading_is_an_error_not_a_crash(clock):
    b = inline(clock, {"0": {"TotalEccErrors_UNCORRECTED_VOLATILE": {"error": "Unknown Error", "code": 999}}})
    s = Sweeper(ecc.create(), b, clock)
    assert problems(s.sweep()) == []
    errs = s.last_obs.errors
    assert [(e.gpu, e.key, e.code) for e in errs] == [(0, "TotalEccErrors_UNCORRECTED_VOLATILE", 999)]
    assert "uncorrected_volatile" in s.last_obs.per_gpu[1]  # the other GPU is still read


def test_ecc_disabled_is_a_warning_and_mode_is_read_once(clock):
    b = inline(clock, {"1": {"EccMode": [0, 1], "CurrentEccMode": 0,
                             "TotalEccErrors_UNCORRECTED_VOLATILE": {"error": "Not Supported", "code": 3}}})
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name: str):
            return getattr(b, name)

        def query(self, index: int, key: str):
            calls.append(key)
            return b.query(index, key)

    s = Sweeper(ecc.create(), Counting(), clock)
    (off,) = problems(s.sweep())
    assert (off.code, off.severity, off.entity.gpu_index) == ("ecc.disabled", Severity.WARNING, 1)
    assert off.evidence == {"ecc_mode": 0, "ecc_mode_pending": 1} and "next reboot" in off.message
    assert sample_values(s.last_samples, "gpu_ecc_mode_enabled", 1) == [0.0]
    assert sample_values(s.last_samples, "gpu_ecc_mode_enabled", 0) == [1.0]
    assert by_code(s.after(5), "ecc.disabled")  # from the cached mode
    assert calls.count("EccMode") == 2 and calls.count("CurrentEccMode") == 0  # once per GPU
