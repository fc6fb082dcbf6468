"""Fleet screening as pure logic: validating the agents' screens, coverage over a fleet, and the
rotation of screening turns (issue 18)."""

from __future__ import annotations

import math

import pytest

from gpuhealth.coordinator.screening import (
    HANDOVER_S,
    RESEND_MARGIN_S,
    KnownGpu,
    Rotation,
    Screen,
    ScreenBook,
    coverage,
    known_gpus,
    screens_from_pb,
)
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import WireError

NOW = 1_800_000_000.0
DAY = 86_400.0


def _result(uuid: str = "GPU-a", *, finished: float = NOW - 60, started: float | None = None, level: str = "quick",
            result: str = "pass", reason: str = "", trigger: str = "schedule",
            digests: tuple[tuple[str, str], ...] = ()) -> pb.ScreenResult:
    return pb.ScreenResult(gpu_uuid=uuid, gpu_index=0, started_at=finished - 30 if started is None else started,
                           finished_at=finished, level=level, result=result, reason=reason, trigger=trigger,
                           digests=[pb.SdcDigest(key=k, digest=d) for k, d in digests])


def _screens(*results: pb.ScreenResult, node: str = "n1", now: float = NOW) -> list[Screen]:
    return screens_from_pb(pb.ScreenResults(screens=list(results)), node, now)


# ------------------------------------------------------------------------------------ validation


def test_a_valid_screen_is_kept_with_its_digests_and_an_empty_trigger_means_the_schedule() -> None:
    [s] = _screens(_result(trigger="", digests=(("key1", "d1"),), result="fail", reason="digest differs"))
    assert (s.node, s.gpu_uuid, s.gpu_index, s.level, s.result, s.trigger) == ("n1", "GPU-a", 0, "quick", "fail",
                                                                               "schedule")
    assert s.digests == (("key1", "d1"),) and s.completed and s.reason == "digest differs"


@pytest.mark.parametrize(("screen", "message"), [
    (_result(finished=math.nan, started=NOW - 30), r"screens\[1\].finished_at: nan is not a time"),
    (_result(started=math.inf), r"screens\[1\].started_at: inf is not a time"),
    (_result(finished=0.0, started=0.0), "before 2000"),
    (_result(finished=NOW + 2 * DAY), "more than a day ahead"),
    (_result(started=NOW, finished=NOW - 10), "before started_at"),
    (_result(result="passed"), r"screens\[1\].result: 'passed' is not one of pass, fail, aborted, error"),
    (_result(level="extreme"), "level: 'extreme' is not one of"),
    (_result(trigger="cron"), "trigger: 'cron' is not one of"),
    (_result(uuid=""), "gpu_uuid: must be"),
    (_result(reason="x" * 10_000_000), "reason: 10000000 characters is over 4096"),
    (_result(digests=(("", "d"),)), r"digests\[0\].key"),
])
def test_garbage_in_a_screen_is_one_clear_error(screen: pb.ScreenResult, message: str) -> None:
    with pytest.raises(WireError, match=message):
        _screens(_result("GPU-ok"), screen)


def test_the_error_names_the_bad_screen_among_good_ones() -> None:
    with pytest.raises(WireError, match=r"screens\[2\].result"):
        _screens(_result("GPU-0"), _result("GPU-1"), _result("GPU-2", result="?"))


def test_too_many_screens_in_one_record_and_none_at_all_are_refused() -> None:
    many = pb.ScreenResults(screens=[_result(f"GPU-{i}") for i in range(100_000)])
    with pytest.raises(WireError, match="100000 screens in one record is over 1024"):
        screens_from_pb(many, "n1", NOW)
    with pytest.raises(WireError, match="no screen"):
        screens_from_pb(pb.ScreenResults(), "n1", NOW)


def test_a_digest_for_another_gpu_is_refused() -> None:
    bad = _result("GPU-a")
    bad.digests.append(pb.SdcDigest(gpu_uuid="GPU-b", key="k", digest="d"))
    with pytest.raises(WireError, match="not the screen's GPU"):
        _screens(bad)


def test_control_characters_in_a_reason_become_spaces() -> None:
    [s] = _screens(_result(result="error", reason="line1\nline2\x00"))
    assert s.reason == "line1 line2 "


# ------------------------------------------------------------------------------------ coverage


def _book(*screens: pb.ScreenResult, node: str = "n1", now: float = NOW) -> ScreenBook:
    book = ScreenBook()
    for s in _screens(*screens, node=node, now=now):
        book.add(s)
    return book


def test_coverage_counts_completed_screens_within_the_window() -> None:
    gpus = [KnownGpu("n1", f"GPU-{i}", i) for i in range(5)]
    book = _book(_result("GPU-0", finished=NOW - 3600),                       # pass, 1 h ago: covered
                 _result("GPU-1", finished=NOW - 7200, result="fail"),        # fail, 2 h ago: covered (it judged)
                 _result("GPU-2", finished=NOW - 2 * DAY),                     # pass, 2 days ago: outside
                 _result("GPU-3", finished=NOW - 60, result="aborted"),       # aborted: not a screen
                 _result("GPU-3", finished=NOW - 50, result="error"))         # error: not a screen
    for g in gpus:
        book.seen(g, NOW - 10 * DAY)
    cov = coverage(gpus, book, NOW, DAY)
    assert (cov.gpus, cov.screened, cov.unscreened, cov.ratio) == (5, 2, 3, 0.4)
    # The oldest: GPUs 3 and 4 were never screened and first seen 10 days ago — older than GPU 2's screen.
    assert cov.oldest == gpus[3] and cov.oldest_screened_at is None and cov.oldest_age_s == 10 * DAY


def test_the_oldest_is_the_longest_ago_screened_when_never_screened_gpus_are_newer() -> None:
    gpus = [KnownGpu("n1", "GPU-0", 0), KnownGpu("n2", "GPU-9", 1)]
    book = _book(_result("GPU-0", finished=NOW - 3 * DAY))
    book.seen(gpus[0], NOW - 30 * DAY)
    book.seen(gpus[1], NOW - 3600)  # a new node, never screened, seen an hour ago
    cov = coverage(gpus, book, NOW, DAY)
    assert cov.oldest == gpus[0] and cov.oldest_screened_at == NOW - 3 * DAY - 0 and cov.oldest_age_s == 3 * DAY
    assert cov.screened == 0 and cov.ratio == 0.0


def test_an_agent_clock_ahead_does_not_make_a_gpu_look_freshly_screened() -> None:
    gpus = [KnownGpu("n1", "GPU-0", 0)]
    received = NOW - 2 * DAY
    book = _book(_result("GPU-0", finished=received + 3600), now=received)  # agent clock an hour ahead
    assert coverage(gpus, book, NOW, DAY).oldest_age_s == 2 * DAY


def test_coverage_of_a_fleet_with_no_gpus_is_full_and_screens_are_per_node() -> None:
    assert coverage([], ScreenBook(), NOW, DAY).ratio == 1.0
    # The same uuid on another node (simulated nodes, CPU devices) is another GPU.
    book = _book(_result("GPU-0"), node="n1")
    book.seen(KnownGpu("n2", "GPU-0", 0), NOW - 3600)
    cov = coverage([KnownGpu("n1", "GPU-0", 0), KnownGpu("n2", "GPU-0", 0)], book, NOW, DAY)
    assert cov.screened == 1 and cov.oldest == KnownGpu("n2", "GPU-0", 0)


def test_known_gpus_fall_back_to_the_index_without_a_uuid() -> None:
    assert known_gpus("n", [{"index": 0, "uuid": "GPU-x"}, {"index": 1, "uuid": ""}, {"uuid": ""}]) == [
        KnownGpu("n", "GPU-x", 0), KnownGpu("n", "index:1", 1)]


# ------------------------------------------------------------------------------------ rotation


def _fleet(n: int, screened: dict[str, float | None] | None = None) -> dict[str, float | None]:
    return {f"n{i:02d}": (screened or {}).get(f"n{i:02d}") for i in range(n)}


def test_never_screened_nodes_go_first_then_the_longest_unscreened_at_most_a_share_at_a_time() -> None:
    rot = Rotation(turn_s=1800, share=0.1)
    fleet = _fleet(20, {f"n{i:02d}": NOW - i * 3600 for i in range(2, 20)})  # n00, n01 never screened
    offers = rot.plan(NOW, fleet)
    assert sorted(rot.active) == ["n00", "n01"]  # 10 % of 20
    assert offers["n00"].now and offers["n00"].valid_for_s == 1800
    # Everyone else gets a future turn (an agent without a valid turn keeps its own schedule), the
    # longest unscreened first: n19 (19 h ago), n18 …, two per slot length.
    future = {n: o for n, o in offers.items() if not o.now}
    assert len(future) == 18 and all(o.valid_for_s == 1800 for o in future.values())
    order = sorted(future, key=lambda n: (future[n].not_before, n))
    assert order[:4] == ["n18", "n19", "n16", "n17"]
    assert future["n19"].not_before == NOW + 1800 - HANDOVER_S
    assert future["n02"].not_before == NOW + 9 * 1800 - 9 * HANDOVER_S
    # Nothing changed: nothing to send again.
    assert rot.plan(NOW + 10, fleet) == {}


def test_at_least_one_node_holds_a_turn_and_the_share_is_of_connected_nodes() -> None:
    rot = Rotation(turn_s=600, share=0.1)
    rot.plan(NOW, _fleet(5))
    assert len(rot.active) == 1 and rot.slots(5) == 1 and rot.slots(1250) == 125 and rot.slots(0) == 1


def test_a_node_that_reports_its_screen_releases_the_turn_early_and_queues_behind_the_others() -> None:
    rot = Rotation(turn_s=1800, share=0.5)
    fleet = _fleet(4)
    rot.plan(NOW, fleet)
    assert sorted(rot.active) == ["n00", "n01"]
    assert rot.release("n00") is not None
    fleet["n00"] = NOW + 60
    offers = rot.plan(NOW + 60, fleet)
    assert sorted(rot.active) == ["n01", "n02"]
    assert offers["n02"].now
    assert not offers["n00"].now and offers["n00"].not_before > NOW + 60  # told to wait for its next turn
    assert "n01" not in offers  # unchanged


def test_a_node_that_never_screens_cannot_keep_the_slot_from_the_others() -> None:
    rot = Rotation(turn_s=100, share=0.1)
    fleet = _fleet(3)  # all never screened; n00 is always busy and never reports
    seen = []
    t = NOW
    for _ in range(3):
        rot.plan(t, fleet)
        seen += list(rot.active)
        rot.release(next(iter(rot.active))) if seen[-1] != "n00" else None
        fleet.update({n: t for n in rot.active if n != "n00"})  # the others screen in their turn
        t += 101
    assert seen == ["n00", "n01", "n02"]


def test_a_turn_expires_and_the_next_node_gets_it() -> None:
    rot = Rotation(turn_s=1800, share=0.1)
    fleet = _fleet(2)
    rot.plan(NOW, fleet)
    assert list(rot.active) == ["n00"]
    assert rot.plan(NOW + 1800 - HANDOVER_S - 1, fleet) == {}
    offers = rot.plan(NOW + 1800 - HANDOVER_S, fleet)  # handed over just before the agent's window closes
    assert list(rot.active) == ["n01"] and offers["n01"].now
    assert not offers["n00"].now  # its next turn replaces the lapsing one on the agent


def test_a_node_pushed_back_is_told_its_later_turn_before_the_old_one_opens() -> None:
    rot = Rotation(turn_s=1000, share=0.1)
    fleet = _fleet(2, {"n00": NOW - 100, "n01": NOW - 50})
    offers = rot.plan(NOW, fleet)
    assert list(rot.active) == ["n00"] and offers["n01"].not_before == NOW + 1000 - HANDOVER_S
    # A never-screened node arrives and goes ahead of n01.
    fleet["new"] = None
    offers = rot.plan(NOW + 10, fleet)
    assert offers.keys() == {"new"} and not offers["new"].now  # n01 not yet: its old turn opens much later
    t = NOW + 1000 - HANDOVER_S - RESEND_MARGIN_S + 1  # now n01's old turn opens within the margin
    offers = rot.plan(t, fleet)
    assert offers.keys() == {"n01"} and offers["n01"].not_before == NOW + 2000 - 2 * HANDOVER_S
    offers = rot.plan(NOW + 1000 - HANDOVER_S, fleet)
    assert list(rot.active) == ["new"] and offers["new"].now
    assert "n01" not in offers and offers["n00"].not_before == NOW + 3000 - 3 * HANDOVER_S


def test_a_reconnected_node_hears_its_turn_again_and_a_disconnected_holder_keeps_it_until_it_ends() -> None:
    rot = Rotation(turn_s=1800, share=0.1)
    fleet = _fleet(3)
    rot.plan(NOW, fleet)
    del fleet["n00"]  # n00 (the holder) disconnects: its slot stays taken until the turn ends
    assert rot.plan(NOW + 10, fleet) == {} and list(rot.active) == ["n00"]
    fleet["n00"] = None
    rot.forget_sent("n00")
    offers = rot.plan(NOW + 20, fleet)
    assert offers.keys() == {"n00"} and offers["n00"].now and offers["n00"].valid_for_s == 1780


def test_the_plan_is_deterministic() -> None:
    fleet = _fleet(50, {f"n{i:02d}": NOW - (i % 7) * 100 for i in range(50)})
    a, b = Rotation(600, 0.1), Rotation(600, 0.1)
    assert a.plan(NOW, fleet) == b.plan(NOW, dict(reversed(list(fleet.items()))))
    assert a.active == b.active
