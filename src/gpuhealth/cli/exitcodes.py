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


# The profiles that answer "fit to run a job?": a finding that asks for a reset, a reboot or a drain makes
# the node unfit whatever its severity (``Action.takes_node_out``: a power brake is a warning that means drain).
_FIT_PROFILES = frozenset({Profile.SLURM, Profile.NPD})


def exit_code(health: Health, profile: str | Profile = Profile.DEFAULT, *, takes_node_out: bool = False) -> int:
    """The profile's code for ``health``; ``takes_node_out`` (``model.takes_node_out(findings)``) turns a
    fit answer of the Slurm and node-problem-detector profiles into "not fit" / "problem"."""
    p = Profile(profile)
    code = _TABLE[p][health]
    if takes_node_out and p in _FIT_PROFILES and code == 0:
        return 1
    return code
