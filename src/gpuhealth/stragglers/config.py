"""Knobs of the straggler detector. The defaults are the tuned ones (benchmarks/straggler_quality.py,
seeds 0–4); docs/stragglers.md explains each in plain words."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StragglerConfig:
    # A straggler is at least this much slower than the other ranks (trimmed mean over a window).
    min_ratio: float = 1.05
    # False-alarm budget of one evaluation of the whole job: split over ranks and window lengths
    # (Bonferroni), so a 1,024-rank job needs stronger evidence per rank than a 4-rank one.
    alpha: float = 1e-4
    # Windows (steps) looked back over; a long one sees a small slowdown through noise, a short one
    # sees a large slowdown soon. Each is evaluated every max(eval_every, window // 8) steps.
    windows: tuple[int, ...] = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    eval_every: int = 4
    trim: float = 0.2  # trimmed mean: 20 % cut from each end of the window
    # Persistence: at least this share of the window's steps are slower than half the rank's excess
    # (a rank slow on every other step has 50 %; three spikes in eight steps have 37 %).
    min_slow_fraction: float = 0.4
    # Leaving an episode needs clear recovery: excess + exit_z × its standard error below half the
    # entry floor or a third of the episode's worst excess, whichever is larger — noise never ends
    # an episode, and a rank hovering at the floor does not flicker.
    exit_z: float = 3.0
    critical_cost_share: float = 1 / 3  # the others wait ≥ a third of the step for it → critical
    # Flight-recorder durations without start times have no step to be relative to: a rank must
    # make the others wait at least this long per step (with start times, min_ratio applies).
    fr_min_lateness_s: float = 0.0005
    # The whole job slower than its own best pace by this much → job.slowdown (never a straggler).
    job_slowdown_ratio: float = 1.2
    job_window: int = 32
    history: int = 256  # steps kept per rank (fewer for very large jobs: ≤ 16 Mi values in all)
    max_pending_steps: int = 64  # online: steps waiting for late ranks before being judged anyway
    min_ranks: int = 2  # a step needs this many ranks to compare
