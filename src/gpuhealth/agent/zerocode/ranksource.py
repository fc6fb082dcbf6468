"""Instrumented and discovered ranks as one source for the coordinator link.

The link asks one object for a job's ranks, their dumps and stacks, and listens for identities and
step records. A rank the hook reports (the rank socket) is asked through the hook; a rank only
discovery knows is asked through its FIFO and py-spy. A rank known both ways is the hook's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from gpuhealth.agent.zerocode.watcher import ZeroCodeWatcher
from gpuhealth.model import RankIdentity, StepRecord


class HookRanks(Protocol):
    """The rank hub as this source uses it (``ranks.RankHub``)."""

    def ranks(self, job_id: str | None = None) -> list[RankIdentity]: ...

    def iter_dumps(self, job_id: str, rank: int | None, out_dir: str | None = None, timeout_s: float = 30.0
                   ) -> Iterator[tuple[int, bytes | bytearray | str | Exception]]: ...

    def request_stacks(self, job_id: str, rank: int | None, timeout_s: float = 10.0
                       ) -> dict[int, dict[str, Any] | Exception]: ...

    def add_listener(self, on_identity: Callable[[RankIdentity], None] | None = None,
                     on_steps: Callable[[RankIdentity | None, Sequence[StepRecord]], None] | None = None,
                     ) -> None: ...


class CombinedRanks:
    def __init__(self, hub: HookRanks | None, watcher: ZeroCodeWatcher) -> None:
        self.hub = hub
        self.watcher = watcher

    def _hooked(self, job_id: str | None) -> set[tuple[str, int]]:
        return {(i.job_id, i.rank) for i in self.hub.ranks(job_id)} if self.hub is not None else set()

    def ranks(self, job_id: str | None = None) -> list[RankIdentity]:
        hooked = self.hub.ranks(job_id) if self.hub is not None else []
        keys = {(i.job_id, i.rank) for i in hooked}
        found = [i for i in self.watcher.ranks(job_id) if (i.job_id, i.rank) not in keys]
        return sorted([*hooked, *found], key=lambda i: (i.job_id, i.rank))

    def iter_dumps(self, job_id: str, rank: int | None, out_dir: str | None = None, timeout_s: float = 30.0
                   ) -> Iterator[tuple[int, bytes | bytearray | str | Exception]]:
        hooked = {r for j, r in self._hooked(job_id)}
        if self.hub is not None and (rank is None or rank in hooked):
            yield from self.hub.iter_dumps(job_id, rank, out_dir, timeout_s)
        if rank is not None and rank in hooked:
            return
        for r, res in self.watcher.iter_dumps(job_id, rank, out_dir, timeout_s):
            if r not in hooked:
                yield r, res

    def request_stacks(self, job_id: str, rank: int | None, timeout_s: float = 10.0
                       ) -> dict[int, dict[str, Any] | Exception]:
        out: dict[int, dict[str, Any] | Exception] = {}
        if self.hub is not None:
            out.update(self.hub.request_stacks(job_id, rank, timeout_s))
        hooked = {r for j, r in self._hooked(job_id)}
        # discovered ranks: the link adds py-spy by pid itself; say plainly that no hook answers
        for ident in self.watcher.ranks(job_id):
            if ident.rank not in hooked and (rank is None or ident.rank == rank):
                out.setdefault(ident.rank, LookupError(f"rank {ident.rank} runs no gpuhealth hook (found by "
                                                       "discovery): stacks come from py-spy"))
        return out

    def traceable_pid(self, ident: RankIdentity) -> int | None:
        """A discovered rank's pid is the agent's own finding (from /proc); a hooked rank's is the rank
        socket's word, judged by the hub when it runs apart (``RankProcess.traceable_pid``)."""
        if any(i.pid == ident.pid and i.rank == ident.rank for i in self.watcher.ranks(ident.job_id)):
            return ident.pid
        judge = getattr(self.hub, "traceable_pid", None)
        return judge(ident) if judge is not None else ident.pid

    def add_listener(self, on_identity: Callable[[RankIdentity], None] | None = None,
                     on_steps: Callable[[RankIdentity | None, Sequence[StepRecord]], None] | None = None,
                     ) -> None:
        if self.hub is not None:
            self.hub.add_listener(on_identity=on_identity, on_steps=on_steps)
        self.watcher.add_listener(on_identity=on_identity)


__all__ = ["CombinedRanks", "HookRanks"]
