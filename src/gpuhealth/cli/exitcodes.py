"""Exit-code profiles (docs/architecture.md, Contracts): the same verdict, spoken in the dialect of the caller."""

from __future__ import annotations

import enum

from gpuhealth.model import Health


class Profile(enum.StrEnum):
    DEFAULT = "default"  # 0 healthy, 1 degraded, 2 unhealthy, 3 could not check
    SLURM = "slurm"  # 0 fit, 1 not fit
    NPD = "npd"  # node-problem-detector: 0 OK, 1 problem, 2 unknown
    NAGIOS = "nagios"  # 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN


PROFILE_NAMES = [p.value for p in Profile]

# A bad flag or argument is not a verdict: sysexits.h EX_USAGE, distinct from every profile's codes
# (click's own 2 would read as "unhealthy" / Nagios CRITICAL).
USAGE_ERROR = 64

_TABLE: dict[Profile, dict[Health, int]] = {
    Profile.DEFAULT: {Health.HEALTHY: 0, Health.DEGRADED: 1, Health.UNHEALTHY: 2, Health.UNKNOWN: 3},
    # Slurm: a degraded node is still fit to run a job; unhealthy or unknown is not.
    Profile.SLURM: {Health.HEALTHY: 0, Health.DEGRADED: 0, Health.UNHEALTHY: 1, Health.UNKNOWN: 1},
    Profile.NPD: {Health.HEALTHY: 0, Health.DEGRADED: 1, Health.UNHEALTHY: 1, Health.UNKNOWN: 2},
    Profile.NAGIOS: {Health.HEALTHY: 0, Health.DEGRADED: 1, Health.UNHEALTHY: 2, Health.UNKNOWN: 3},
}


def exit_code(health: Health, profile: str | Profile = Profile.DEFAULT) -> int:
    return _TABLE[Profile(profile)][health]
