"""Versions: driver, CUDA driver API, NVML, and per GPU the VBIOS, InfoROM image and GSP firmware.

Reported as info samples (labels carry the versions). GPUs of one model on one node should run the
same VBIOS and InfoROM image and the GSP firmware of the loaded driver; anything else is
``version.drift`` (warning): such nodes give different numbers and fail in different ways, and it
is how a half-finished firmware update shows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from gpuhealth.backends.errors import NvmlError
from gpuhealth.collectors.base import CollectContext, History, Lane, Observations
from gpuhealth.model import Action, Entity, Finding, MetricKind, Sample, Severity

NAME = "versions"
_PER_GPU = {
    "VbiosVersion": "vbios",
    "InforomImageVersion": "inforom",
    "GspFirmwareVersion": "gsp_firmware",
    "GspFirmwareMode": "gsp_mode",
}
# Which per-GPU versions must agree among GPUs of the same model, with the words for messages.
_MUST_MATCH = (("vbios", "VBIOS"), ("inforom", "InfoROM image"), ("gsp_firmware", "GSP firmware"))


def cuda_version_text(raw: Any) -> str | None:
    """NVML's CUDA driver version integer (13000) → "13.0"."""
    if isinstance(raw, int) and raw > 0:
        return f"{raw // 1000}.{(raw % 1000) // 10}"
    return None


class VersionsCollector:
    name = NAME
    lane = Lane.SLOW  # versions change only with a driver or firmware update

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(collector=self.name, time=ctx.now)
        for key in ("driver", "nvml_version", "cuda_driver"):
            try:
                obs.node[key] = ctx.backend.system(key)
            except NvmlError as exc:
                obs.note_error(None, key, exc)
        cuda = cuda_version_text(obs.node.get("cuda_driver"))
        if cuda:
            obs.node["cuda"] = cuda
        for g in ctx.gpus:
            data = obs.gpu(g.index)
            data["name"] = g.name
            for key, short in _PER_GPU.items():
                value = obs.read(ctx.backend, g.index, key, store_as=short)
                if value is None:
                    data.pop(short, None)
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        out: list[Finding] = []
        by_model: dict[str, list[int]] = defaultdict(list)
        for i, data in sorted(obs.per_gpu.items()):
            by_model[str(data.get("name", "?"))].append(i)
        for model, indices in sorted(by_model.items()):
            for field, words in _MUST_MATCH:
                seen = {i: str(obs.per_gpu[i][field]) for i in indices if obs.per_gpu[i].get(field)}
                if len(set(seen.values())) > 1:
                    out.append(_drift(ctx, f"{words} differs across the {len(indices)} {model} GPUs",
                                      {"field": field, "model": model, "per_gpu": seen}))
        driver = obs.node.get("driver")
        if driver:
            off = {i: str(d["gsp_firmware"]) for i, d in sorted(obs.per_gpu.items())
                   if _gsp_enabled(d) and d.get("gsp_firmware") and str(d["gsp_firmware"]) != str(driver)}
            if off:
                out.append(_drift(ctx, f"GSP firmware does not match the loaded driver {driver}",
                                  {"field": "gsp_firmware", "driver": driver, "per_gpu": off}))
        return out

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        labels = tuple((k, str(obs.node[k])) for k in ("driver", "cuda", "nvml_version") if obs.node.get(k))
        if labels:
            yield Sample("driver_info", 1.0, "Driver, CUDA driver API and NVML versions", MetricKind.INFO,
                         labels=labels)
        for i, data in sorted(obs.per_gpu.items()):
            gl = tuple((k, str(data[k])) for k in ("vbios", "inforom", "gsp_firmware") if data.get(k))
            if gl:
                yield Sample("gpu_firmware_info", 1.0, "VBIOS, InfoROM image and GSP firmware of the GPU",
                             MetricKind.INFO, gpu=i, labels=gl)


def _gsp_enabled(data: dict[str, Any]) -> bool:
    mode = data.get("gsp_mode")
    return isinstance(mode, (list, tuple)) and bool(mode) and bool(mode[0])


def _drift(ctx: CollectContext, message: str, evidence: dict[str, Any]) -> Finding:
    return Finding(code="version.drift", severity=Severity.WARNING, entity=Entity.node(ctx.node_name),
                   message=message, action=Action.MONITOR, evidence=evidence, source=NAME)


def versions_of(obs: Observations | None) -> dict[str, Any]:
    """The node's versions as plain data (``NodeReport.versions``)."""
    if obs is None:
        return {}
    out: dict[str, Any] = {k: obs.node[k] for k in ("driver", "cuda", "cuda_driver", "nvml_version")
                           if k in obs.node}
    out["gpus"] = {str(i): {k: d[k] for k in ("vbios", "inforom", "gsp_firmware") if k in d}
                   for i, d in sorted(obs.per_gpu.items())}
    return out


def create() -> VersionsCollector:
    return VersionsCollector()
