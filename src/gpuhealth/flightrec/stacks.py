"""Where a rank's main thread is, from a live stack capture (the instrument hook's, or ``py-spy dump
--json``), as evidence next to the flight recorder.

The flight recorder cannot see everything a rank waits in: Gloo records no send/recv at all, so in a
pipeline hang on Gloo every downstream stage looks like a rank that "never posted" the next collective —
exactly like the stage that is really stuck on the host. A stack settles it: a rank whose main thread is
inside ``torch.distributed`` is waiting in communication, not stuck on the host.

Accepted shapes (what the coordinator stores per rank in ``stacks.json``): ``{"hook": {"threads": [{"main":
bool, "frames": [{"file", "line", "function"}]}]}}`` (innermost frame last) and ``{"py_spy": [{"thread_name",
"frames": [{"name", "filename", "line"}]}]}`` (innermost frame first); either alone or both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_TORCH_DISTRIBUTED = "/torch/distributed/"
MAX_FRAMES = 8


@dataclass(frozen=True, slots=True)
class MainThread:
    frames: tuple[tuple[str, str, int], ...]  # (function, file, line), outermost first

    def in_communication(self) -> str | None:
        """The torch.distributed call the main thread is blocked in ("recv", "all_reduce"), or None."""
        for function, file, _line in self.frames:
            if _TORCH_DISTRIBUTED in file.replace("\\", "/"):
                return function  # the outermost torch.distributed frame: the API the job called
        return None

    def call_site(self) -> list[str]:
        """The innermost frames outside torch.distributed, innermost first (what the job was doing)."""
        own = [f for f in self.frames if _TORCH_DISTRIBUTED not in f[1].replace("\\", "/")]
        return [f"{fn} at {file}:{line}" for fn, file, line in reversed(own[-MAX_FRAMES:])]


def main_thread(stack: Any) -> MainThread | None:
    """The main thread of one rank's stack capture, or None when the capture has none we can read."""
    if not isinstance(stack, Mapping):
        return None
    hook = stack.get("hook")
    if isinstance(hook, Mapping):
        threads = hook.get("threads")
        if isinstance(threads, Sequence):
            main = next((t for t in threads if isinstance(t, Mapping) and t.get("main")), None)
            if main is not None:
                frames = _frames(main.get("frames"), "function", "file")
                if frames:
                    return MainThread(frames)
    spy = stack.get("py_spy")
    if isinstance(spy, Sequence) and spy:
        main = next((t for t in spy if isinstance(t, Mapping) and t.get("thread_name") == "MainThread"), spy[0])
        if isinstance(main, Mapping):
            frames = _frames(main.get("frames"), "name", "filename")
            if frames:
                return MainThread(tuple(reversed(frames)))  # py-spy lists the innermost frame first
    return None


def _frames(raw: Any, name_key: str, file_key: str) -> tuple[tuple[str, str, int], ...]:
    if not isinstance(raw, Sequence):
        return ()
    out = []
    for f in raw[-256:] if len(raw) > 256 else raw:
        if isinstance(f, Mapping):
            line = f.get("line")
            out.append((str(f.get(name_key, "?"))[:200], str(f.get(file_key, "?"))[:500],
                        line if isinstance(line, int) else 0))
    return tuple(out)


def main_threads(stacks: Mapping[Any, Any] | None) -> dict[int, MainThread]:
    """{rank: main thread} for every rank whose capture can be read (keys may be strings, as in JSON)."""
    out: dict[int, MainThread] = {}
    for key, stack in (stacks or {}).items():
        try:
            rank = int(key)
        except (TypeError, ValueError):
            continue
        main = main_thread(stack)
        if main is not None:
            out[rank] = main
    return out
