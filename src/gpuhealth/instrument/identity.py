"""Who this training process is: rank, world size, job id, host, pid and GPU, from the environment.

torch is consulted only when the training script already imported it (``sys.modules``): the hook
itself never pulls torch in for identity.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

from gpuhealth.model import RankIdentity

# Explicit override first, then the schedulers/launchers that name a job.
JOB_ID_VARS = ("GPUHEALTH_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
UNKNOWN_JOB = "unknown"


def _int_env(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return None


def job_id_from_env(env: Mapping[str, str]) -> str:
    for var in JOB_ID_VARS:
        value = env.get(var, "").strip()
        # torchrun sets TORCHELASTIC_RUN_ID=none when no --rdzv-id is given: not a job id.
        if value and value.lower() != "none":
            return value
    return UNKNOWN_JOB


def _dist_rank_world() -> tuple[int | None, int | None]:
    torch = sys.modules.get("torch")
    if torch is None:
        return None, None
    try:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:
        pass
    return None, None


def cuda_gpu(local_rank: int | None, env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """(NVML-style UUID "GPU-…", physical index) of this process's CUDA device, when torch is
    loaded and CUDA is available; (None, None) otherwise."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None, None
    try:
        if not torch.cuda.is_available():
            return None, None
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else (local_rank or 0)
        index = min(index, torch.cuda.device_count() - 1)
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return None, None
    if not uuid.startswith("GPU-"):
        uuid = "GPU-" + uuid
    # torch numbers devices after CUDA_VISIBLE_DEVICES; NVML (the agent) numbers physical GPUs.
    visible = env.get("CUDA_VISIBLE_DEVICES")
    physical: int | None = index
    if visible is not None:
        parts = [p.strip() for p in visible.split(",") if p.strip()]
        physical = int(parts[index]) if index < len(parts) and parts[index].isdigit() else None
    return uuid, physical


def identity_from_env(env: Mapping[str, str] | None = None, *, job_id: str | None = None) -> RankIdentity:
    """RANK/WORLD_SIZE/LOCAL_RANK (torchrun) or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, else the
    initialized torch.distributed group, else rank 0 of 1. The GPU is torch's current CUDA device,
    unless GPUHEALTH_GPU_UUID / GPUHEALTH_GPU_INDEX name it."""
    env = os.environ if env is None else env
    rank = _int_env(env, "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
    world = _int_env(env, "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
    if rank is None or world is None:
        d_rank, d_world = _dist_rank_world()
        rank = rank if rank is not None else d_rank
        world = world if world is not None else d_world
    local_rank = _int_env(env, "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
    gpu_uuid, gpu_index = cuda_gpu(local_rank, env)
    # A launcher that knows the mapping better (or a process that drives its GPU through another one)
    # may say so outright; the agent joins the rank with this GPU's health.
    if env.get("GPUHEALTH_GPU_UUID"):
        gpu_uuid = env["GPUHEALTH_GPU_UUID"]
    if (idx := _int_env(env, "GPUHEALTH_GPU_INDEX")) is not None:
        gpu_index = idx
    return RankIdentity(
        job_id=job_id or job_id_from_env(env),
        rank=rank if rank is not None else 0,
        world_size=world if world is not None else 1,
        host=socket.gethostname(),
        pid=os.getpid(),
        local_rank=local_rank,
        gpu_uuid=gpu_uuid,
        gpu_index=gpu_index,
    )
