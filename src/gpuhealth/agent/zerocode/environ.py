"""What a process's environment says about it: which job and rank it is, and what its launch enabled.

Read from ``/proc/<pid>/environ`` (the environment the process was started with; NUL-separated,
readable by its own user and by root). The variable names are the launchers' and PyTorch's own:

- job: ``GPUHEALTH_JOB_ID``, else ``SLURM_JOB_ID``, else ``TORCHELASTIC_RUN_ID`` (the order the
  instrument hook uses, so a job seen both ways has one id); a torch job with none of them is
  named by its rendezvous, ``torch:<MASTER_ADDR>:<MASTER_PORT>``.
- rank: ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (torchrun), else Slurm's and Open MPI's.
- what the launch enabled: the flight-recorder pipe (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``, or the generic
  ``TORCH_FR_DEBUG_INFO_PIPE_FILE``), where the
  dump goes (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` / ``TORCH_FR_DUMP_TEMP_FILE``), the ring buffer
  (``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE``), timing, and NCCL's RAS service
  (``NCCL_RAS_ENABLE``, ``NCCL_RAS_ADDR``).

``launch_variables`` is the other direction: what ``gpuhealth env`` prints for a launch to export.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

JOB_ID_VARS = ("GPUHEALTH_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
PIPE_VARS = ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_FR_DEBUG_INFO_PIPE_FILE")  # NCCL's, the generic one
DUMP_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
TIMING_VAR = "TORCH_NCCL_ENABLE_TIMING"
RAS_ENABLE_VAR = "NCCL_RAS_ENABLE"
RAS_ADDR_VAR = "NCCL_RAS_ADDR"
DEFAULT_RAS_PORT = 28028
# What marks a process as a torch.distributed / NCCL rank (besides a rank variable).
_TORCH_MARKS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "NCCL_SOCKET_IFNAME")
MAX_RANK = 1 << 20  # as model.MAX_RANKS: a larger number is not a rank


@dataclass(frozen=True, slots=True)
class LaunchInfo:
    """One process's job, rank and launch options, as its environment states them."""

    job_id: str | None
    rank: int | None
    world_size: int | None
    local_rank: int | None
    pipe_prefix: str | None  # TORCH_NCCL_DEBUG_INFO_PIPE_FILE: the rank's FIFO is <prefix><rank>.pipe
    dump_prefix: str | None  # where the rank writes its dump: <prefix><rank>
    fr_buffer: int | None  # flight-recorder entries (None: not set; 0: off)
    timing: bool  # TORCH_NCCL_ENABLE_TIMING=1: entries carry duration_ms
    ras_enabled: bool  # NCCL_RAS_ENABLE is not 0
    ras_host: str
    ras_port: int
    torch_like: bool  # a torch.distributed/NCCL rank by its variables

    @property
    def is_rank(self) -> bool:
        return self.torch_like and self.rank is not None and self.world_size is not None and self.job_id is not None

    @property
    def dump_ready(self) -> str | None:
        """None when the launch lets the agent trigger a dump through the FIFO; else what is missing."""
        missing = []
        if not self.pipe_prefix:
            missing.append(PIPE_VARS[0])
        if not self.dump_prefix:
            missing.append(f"{DUMP_VARS[1]} (or {DUMP_VARS[0]})")
        if not self.fr_buffer:
            missing.append(f"{BUFFER_VARS[0]}>0")
        return None if not missing else "not set at launch: " + ", ".join(missing)


def parse_environ(data: bytes) -> dict[str, str]:
    """``/proc/<pid>/environ`` bytes → {name: value}; undecodable bytes are replaced, junk skipped."""
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            env[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def _int(env: Mapping[str, str], names: tuple[str, ...], low: int, high: int) -> int | None:
    for name in names:
        text = env.get(name, "").strip()
        if text.isdigit() and low <= int(text) <= high:
            return int(text)
    return None


def job_id_of(env: Mapping[str, str]) -> str | None:
    for var in JOB_ID_VARS:
        value = env.get(var, "").strip()
        if value and value.lower() != "none":  # torchrun's TORCHELASTIC_RUN_ID=none: no --rdzv-id given
            return value[:256]
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    if addr and port:
        return f"torch:{addr}:{port}"[:256]
    return None


def ras_address(env: Mapping[str, str]) -> tuple[str, int]:
    """NCCL_RAS_ADDR (``host:port``, ``[v6]:port`` or ``host``), else localhost:28028."""
    text = env.get(RAS_ADDR_VAR, "").strip()
    if not text:
        return "localhost", DEFAULT_RAS_PORT
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.lstrip(":")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host:  # no port, or a bare IPv6 address
            host, port_text = text, ""
    port = int(port_text) if port_text.isdigit() and 0 < int(port_text) < 65536 else DEFAULT_RAS_PORT
    return host or "localhost", port


def launch_info(env: Mapping[str, str]) -> LaunchInfo:
    rank = _int(env, RANK_VARS, 0, MAX_RANK - 1)
    world = _int(env, WORLD_VARS, 1, MAX_RANK)
    if rank is not None and world is not None and rank >= world:
        rank = world = None  # contradicting variables say nothing we can use
    buffer = _int(env, BUFFER_VARS, 0, 1 << 31)
    host, port = ras_address(env)
    torch_like = any(env.get(v) for v in _TORCH_MARKS) or (env.get("RANK") is not None and
                                                           env.get("WORLD_SIZE") is not None)
    return LaunchInfo(
        job_id=job_id_of(env), rank=rank, world_size=world,
        local_rank=_int(env, LOCAL_RANK_VARS, 0, MAX_RANK - 1),
        pipe_prefix=next((env[v] for v in PIPE_VARS if env.get(v)), None),
        dump_prefix=next((env[v] for v in DUMP_VARS if env.get(v)), None),
        fr_buffer=buffer, timing=env.get(TIMING_VAR, "").strip() == "1",
        ras_enabled=env.get(RAS_ENABLE_VAR, "1").strip() != "0",
        ras_host=host, ras_port=port, torch_like=torch_like,
    )


def launch_variables(tag: str, *, folder: str = "/tmp", buffer_entries: int = 2000, timing: bool = True
                     ) -> dict[str, str]:
    """The variables a launch exports so the agent can take flight-recorder dumps from a live job: rank R
    makes the FIFO ``<folder>/gpuhealth-<tag>-pipe-<R>.pipe`` and writes its dump to
    ``<folder>/gpuhealth-<tag>-fr-<R>``. Flat names in an existing folder (``/tmp`` by default): NCCL
    makes the FIFO at start and a missing folder would fail the rank; ``tag`` (the job's id) keeps two
    jobs on one node apart."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in tag)[:64] or "job"
    base = f"{folder.rstrip('/') or ''}/gpuhealth-{safe}-"
    out = {PIPE_VARS[0]: base + "pipe-", PIPE_VARS[1]: base + "pipe-", DUMP_VARS[1]: base + "fr-",
           DUMP_VARS[0]: base + "fr-", BUFFER_VARS[0]: str(buffer_entries)}
    if timing:
        out[TIMING_VAR] = "1"
    return out


__all__ = ["LaunchInfo", "job_id_of", "launch_info", "launch_variables", "parse_environ", "ras_address"]
