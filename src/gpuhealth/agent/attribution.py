"""Who holds each GPU: extra metric labels per GPU, as dcgm-exporter adds them.

Two sources, both optional and both cheap enough to ask every few seconds:

* **Kubernetes**: the kubelet PodResources v1 API (``List()`` on
  ``config.agent.pod_resources_socket``). Devices of resource ``nvidia.com/gpu``,
  ``nvidia.com/gpu.shared`` (time-slicing with ``renameByDefault``) and ``nvidia.com/mig-*`` give ``pod``,
  ``namespace`` and ``container``. The NVIDIA device plugin
  advertises GPU UUIDs (``GPU-…``) or MIG UUIDs (``MIG-…``); with time-slicing a replica suffix
  ``::<n>`` is appended, which we strip. Some plugins (GKE) advertise ``nvidia<N>``: that is a GPU
  index.
* **Slurm**: a job-mapping directory (``config.agent.slurm_job_dir``) that the prolog fills with
  one file per GPU, named by GPU UUID or GPU index, holding the job id; the epilog removes them.
  This gives ``slurm_job_id``.

The provider returns ``{gpu_key: {label: value}}``. ``gpu_key`` is the GPU UUID (or MIG UUID)
when the source names one; a GPU known only by index is keyed by its decimal index (``"0"``)
unless an ``index_to_uuid`` callable was given to translate it. Consumers look up by UUID first,
then by ``str(index)``.

Results are cached for ``ttl_s``; any failure is logged (once per distinct error) and yields the
last good answer for that source for up to ``FAILURE_GRACE_S`` (then nothing), never an
exception: a scrape must not fail, nor labels flap, because the kubelet is restarting. gRPC is
an optional extra, imported only on the kubelet path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuhealth.config import Config

log = logging.getLogger(__name__)

Labels = Mapping[str, Mapping[str, str]]
LabelProvider = Callable[[], Labels]
IndexToUuid = Callable[[], Mapping[int, str]]

GPU_RESOURCE = "nvidia.com/gpu"
SHARED_GPU_RESOURCE = "nvidia.com/gpu.shared"  # time-sliced / MPS replicas under the device plugin's renameByDefault
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
POD_LABELS = ("pod", "namespace", "container")
SLURM_LABEL = "slurm_job_id"
DEFAULT_TTL_S = 10.0
KUBELET_TIMEOUT_S = 2.0
# Big nodes list many pods; the kubelet's own client allows 16 MiB.
KUBELET_MAX_MESSAGE = 16 * 1024 * 1024
MAX_MAPPING_FILE_BYTES = 4096
# How long a failing source's last good answer is still used (a kubelet restart takes seconds).
FAILURE_GRACE_S = 120.0


def is_gpu_resource(resource_name: str) -> bool:
    """``nvidia.com/gpu``, ``nvidia.com/gpu.shared`` (time-slicing or MPS with the device plugin's
    ``renameByDefault``), and every ``nvidia.com/mig-<profile>[.shared]``."""
    return resource_name in (GPU_RESOURCE, SHARED_GPU_RESOURCE) or resource_name.startswith(MIG_RESOURCE_PREFIX)


def normalize_device_id(device_id: str) -> str:
    """``GPU-x::3`` (time-sliced replica) → ``GPU-x``; ``nvidia2`` (GKE) → ``"2"``; else as is."""
    device_id = device_id.strip().split("::", 1)[0]
    if device_id.startswith("nvidia") and device_id[len("nvidia"):].isdigit():
        return device_id[len("nvidia"):]
    return device_id


def _merge(into: dict[str, dict[str, str]], key: str, labels: Mapping[str, str]) -> None:
    """Add ``labels`` for ``key``; when two holders share a GPU (time-slicing), join the values
    sorted with commas so the label stays one stable string."""
    current = into.setdefault(key, {})
    for name, value in labels.items():
        if not value:
            continue
        old = current.get(name)
        if old is None or old == value:
            current[name] = value
        else:
            current[name] = ",".join(sorted(set(old.split(",")) | {value}))


def pod_labels_from_response(response: object) -> dict[str, dict[str, str]]:
    """Pure: a ``ListPodResourcesResponse`` → GPU key → pod/namespace/container."""
    out: dict[str, dict[str, str]] = {}
    for pod in getattr(response, "pod_resources", ()):
        for container in pod.containers:
            for devices in container.devices:
                if not is_gpu_resource(devices.resource_name):
                    continue
                for device_id in devices.device_ids:
                    key = normalize_device_id(device_id)
                    if key:
                        _merge(out, key, {"pod": pod.name, "namespace": pod.namespace,
                                          "container": container.name})
    return out


def read_slurm_job_dir(directory: Path) -> dict[str, dict[str, str]]:
    """One file per GPU (name: UUID or index; content: the job id, first line). Files that are
    not plain, too big, empty or unreadable are skipped."""
    out: dict[str, dict[str, str]] = {}
    for entry in sorted(directory.iterdir()):
        name = entry.name
        if name.startswith(".") or not entry.is_file():  # prolog writes .tmp files then renames
            continue
        try:
            with entry.open("rb") as fh:
                raw = fh.read(MAX_MAPPING_FILE_BYTES + 1)
        except OSError as exc:
            log.debug("slurm job map %s unreadable: %s", entry, exc)
            continue
        if len(raw) > MAX_MAPPING_FILE_BYTES:
            continue
        lines = raw.decode("utf-8", "replace").strip().splitlines()
        job_id = lines[0].strip() if lines else ""
        if job_id:
            _merge(out, normalize_device_id(name), {SLURM_LABEL: job_id})
    return out


class _ErrorOnce:
    """Log a failure at WARNING the first time it appears (and when it changes), then DEBUG;
    log recovery once. Keeps a flapping kubelet from flooding the journal."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.last: str | None = None

    def failed(self, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        if text != self.last:
            log.warning("%s failed (labels from it kept from the last good read): %s", self.what, text)
            self.last = text
        else:
            log.debug("%s still failing: %s", self.what, text)

    def ok(self) -> None:
        if self.last is not None:
            log.info("%s works again", self.what)
            self.last = None


class KubeletPodSource:
    """``List()`` on the kubelet PodResources socket, over a fresh unix-socket channel per call
    (calls are TTL-spaced; a cached channel would outlive kubelet restarts badly)."""

    def __init__(self, socket_path: str, timeout_s: float = KUBELET_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def available(self) -> bool:
        return os.path.exists(self.socket_path)

    def read(self) -> dict[str, dict[str, str]]:
        import grpc  # optional extra: only nodes with a kubelet need it

        from gpuhealth.proto.kubelet import api_pb2, api_pb2_grpc

        options = [("grpc.max_receive_message_length", KUBELET_MAX_MESSAGE)]
        with grpc.insecure_channel(f"unix://{self.socket_path}", options=options) as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            response = stub.List(api_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
        return pod_labels_from_response(response)


class SlurmJobDirSource:
    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def available(self) -> bool:
        return self.directory.is_dir()

    def read(self) -> dict[str, dict[str, str]]:
        return read_slurm_job_dir(self.directory)


class _Source:
    """A source with its own last good answer and error log. While a source fails (a kubelet
    restarting, its socket briefly gone) its last good answer is kept for ``grace_s``, so GPU
    series do not lose and regain their labels (new series) on every blip; past that, it is
    dropped rather than shown stale. A Slurm map directory that does not exist simply means no
    job holds a GPU (``missing_means_empty``)."""

    def __init__(
        self,
        name: str,
        impl: KubeletPodSource | SlurmJobDirSource,
        *,
        missing_means_empty: bool,
        grace_s: float = FAILURE_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.impl = impl
        self.errors = _ErrorOnce(name)
        self.missing_means_empty = missing_means_empty
        self.grace_s = grace_s
        self.clock = clock
        self.last_good: dict[str, dict[str, str]] = {}
        self.last_good_at = float("-inf")

    def read(self) -> dict[str, dict[str, str]]:
        try:
            if self.impl.available():
                self.last_good = self.impl.read()
                self.last_good_at = self.clock()
                self.errors.ok()
                return self.last_good
            if self.missing_means_empty:
                self.last_good = {}
                self.last_good_at = self.clock()
                return {}
            raise FileNotFoundError(f"{getattr(self.impl, 'socket_path', '')} is gone")
        except Exception as exc:  # never raise into a scrape
            self.errors.failed(exc)
        if self.clock() - self.last_good_at > self.grace_s:
            self.last_good = {}
        return self.last_good


class AttributionProvider:
    """Callable: merged labels from all sources, cached ``ttl_s``. Thread-safe (scrapes may
    come from several HTTP threads); a refresh happens under the lock so sources are asked at
    most once per TTL."""

    def __init__(
        self,
        sources: list[_Source],
        *,
        ttl_s: float = DEFAULT_TTL_S,
        index_to_uuid: IndexToUuid | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sources = sources
        self._ttl_s = ttl_s
        self._index_to_uuid = index_to_uuid
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: dict[str, dict[str, str]] = {}
        self._expires = float("-inf")

    def __call__(self) -> Labels:
        with self._lock:
            now = self._clock()
            if now >= self._expires:
                self._cached = self._refresh()
                self._expires = now + self._ttl_s
            return self._cached

    def _refresh(self) -> dict[str, dict[str, str]]:
        merged: dict[str, dict[str, str]] = {}
        for source in self._sources:
            for key, labels in source.read().items():
                _merge(merged, key, labels)
        return self._translate_indices(merged)

    def _translate_indices(self, labels: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        if self._index_to_uuid is None or not any(k.isdigit() for k in labels):
            return labels
        try:
            uuids = self._index_to_uuid()
        except Exception as exc:  # keep index keys; the consumer can still match on index
            log.debug("index → UUID lookup failed: %s", exc)
            return labels
        out: dict[str, dict[str, str]] = {}
        for key, value in labels.items():
            target = uuids.get(int(key), key) if key.isdigit() else key
            for name, label in value.items():
                _merge(out, target, {name: label})
        return out


def build_label_provider(
    config: Config,
    *,
    index_to_uuid: IndexToUuid | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    clock: Callable[[], float] = time.monotonic,
) -> LabelProvider | None:
    """The agent's GPU → labels provider, or None when no source applies to this node: no
    kubelet PodResources socket at ``config.agent.pod_resources_socket`` and no
    ``config.agent.slurm_job_dir`` configured. A configured Slurm directory that does not exist
    yet is fine (the first prolog creates it)."""
    sources: list[_Source] = []
    socket_path = config.agent.pod_resources_socket
    if socket_path and os.path.exists(socket_path):
        sources.append(_Source(f"kubelet PodResources List() on {socket_path}", KubeletPodSource(socket_path),
                               missing_means_empty=False, clock=clock))
    if config.agent.slurm_job_dir:
        directory = config.agent.slurm_job_dir
        sources.append(_Source(f"Slurm job map {directory}", SlurmJobDirSource(directory),
                               missing_means_empty=True, clock=clock))
    if not sources:
        return None
    return AttributionProvider(sources, ttl_s=ttl_s, index_to_uuid=index_to_uuid, clock=clock)
