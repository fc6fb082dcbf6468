"""Where golden SDC digests live: one rule, and the places older versions used merged into it.

The rule: ``diag.golden_dir`` (default ``/var/lib/gpuhealth/golden``) as soon as this user can write there —
the folder exists and is writable, or its parent does (the package or the agent makes ``/var/lib/gpuhealth``).
Until then the user's cache, ``$XDG_CACHE_HOME/gpuhealth/diag/golden`` (``~/.cache/…``); it never depends on
the state folders, which move on their own. Goldens recorded in the cache (or, by older versions, under a state
folder) would otherwise vanish the day ``/var/lib/gpuhealth`` appears: whenever the rule picks
``diag.golden_dir``, every such place is merged into it, case by case (``GoldenStore.merge_from``). Nothing is
deleted or overwritten; a contradicting case stays where it was and is reported.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from gpuhealth.config import Config
from gpuhealth.diag.golden import GoldenError, GoldenStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GoldenPlace:
    path: Path
    merged: list[str] = field(default_factory=list)  # one line per old place whose goldens came in now
    problems: list[str] = field(default_factory=list)  # what could not come (kept where it was)


def user_golden_dir() -> Path:
    """The golden store of a user who cannot write ``diag.golden_dir``."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "gpuhealth" / "diag" / "golden"


def _writable(directory: Path) -> bool:
    probe = directory if directory.exists() else directory.parent
    return probe.is_dir() and os.access(probe, os.W_OK)


def old_places(config: Config) -> list[Path]:
    """Where goldens may have been written before the rule: the user cache, and the state folders older
    versions fell back to (``<diag.state_dir>/golden``, ``<agent.state_dir>/diag/golden``)."""
    places = [user_golden_dir(), Path(config.agent.state_dir) / "diag" / "golden"]
    if config.diag.state_dir:
        places.append(Path(config.diag.state_dir) / "golden")
    return places


def resolve_golden_dir(config: Config) -> GoldenPlace:
    """The golden store's folder by the rule, with the old places merged into ``diag.golden_dir`` when it is the
    one."""
    configured = Path(config.diag.golden_dir)
    if not _writable(configured):
        return GoldenPlace(user_golden_dir())
    store = GoldenStore(configured)
    merged: list[str] = []
    problems: list[str] = []
    for old in old_places(config):
        if not old.is_dir() or _same(old, configured):
            continue
        try:
            keys, trouble = store.merge_from(GoldenStore(old))
        except (GoldenError, OSError) as exc:
            problems.append(f"{old}: not merged into {configured}: {exc}")
            continue
        problems += trouble
        if keys:
            merged.append(f"{len(keys)} golden key(s) from {old} merged into {configured} (the old copy is kept)")
    for line in merged:
        log.info("%s", line)
    for line in problems:
        log.warning("golden digests: %s", line)
    return GoldenPlace(configured, merged, problems)


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


__all__ = ["GoldenPlace", "old_places", "resolve_golden_dir", "user_golden_dir"]
