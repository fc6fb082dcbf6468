"""GPU → pod/job attribution against a fake kubelet: a real gRPC server on a unix socket speaking
the kubelet PodResources v1 proto, and a Slurm job-mapping directory as the prolog writes it."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuhealth.agent.attribution import (
    FAILURE_GRACE_S,
    AttributionProvider,
    build_label_provider,
    normalize_device_id,
)
from gpuhealth.config import Config
from gpuhealth.proto.kubelet import api_pb2, api_pb2_grpc

UUID0 = "GPU-0b1c2d3e-0000-1111-2222-333344445555"
UUID1 = "GPU-9f8e7d6c-0000-1111-2222-333344445555"
MIG0 = "MIG-5a4b3c2d-aaaa-bbbb-cccc-ddddeeeeffff"


def _pod(name: str, namespace: str, containers: list[tuple[str, list[tuple[str, list[str]]]]]) -> api_pb2.PodResources:
    return api_pb2.PodResources(
        name=name,
        namespace=namespace,
        containers=[
            api_pb2.ContainerResources(
                name=cname,
                devices=[api_pb2.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in devices],
                cpu_ids=[0, 1],
            )
            for cname, devices in containers
        ],
    )


class FakeKubelet(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self) -> None:
        self.pods: list[api_pb2.PodResources] = []
        self.calls = 0
        self.fail_with: grpc.StatusCode | None = None

    def List(
        self, request: api_pb2.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.ListPodResourcesResponse:
        self.calls += 1
        if self.fail_with is not None:
            context.abort(self.fail_with, "kubelet is restarting")
        return api_pb2.ListPodResourcesResponse(pod_resources=self.pods)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="ghk") as d:
        yield Path(d)


@pytest.fixture
def kubelet(short_tmp: Path) -> Iterator[tuple[FakeKubelet, Path]]:
    sock = short_tmp / "kubelet.sock"
    servicer = FakeKubelet()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        yield servicer, sock
    finally:
        server.stop(grace=None)


def _config(sock: Path | str, slurm_dir: Path | str | None = None) -> Config:
    cfg = Config()
    cfg.agent.pod_resources_socket = str(sock)
    cfg.agent.slurm_job_dir = None if slurm_dir is None else str(slurm_dir)
    return cfg


def test_pods_holding_gpus_and_mig_devices_are_labelled(kubelet: tuple[FakeKubelet, Path]) -> None:
    servicer, sock = kubelet
    servicer.pods = [
        _pod("train-0", "ml", [("trainer", [("nvidia.com/gpu", [UUID0]), ("example.com/nic", ["eth1"])])]),
        _pod("infer-7", "serving", [("server", [("nvidia.com/mig-1g.10gb", [MIG0])])]),
        _pod("web", "default", [("nginx", [])]),
    ]
    provider = build_label_provider(_config(sock))
    assert provider is not None
    labels = provider()
    assert labels == {
        UUID0: {"pod": "train-0", "namespace": "ml", "container": "trainer"},
        MIG0: {"pod": "infer-7", "namespace": "serving", "container": "server"},
    }
    assert UUID1 not in labels  # an idle GPU gets no pod labels


def test_time_sliced_gpu_shared_by_two_pods_gets_both_names(kubelet: tuple[FakeKubelet, Path]) -> None:
    servicer, sock = kubelet
    servicer.pods = [
        _pod("a", "ns", [("c", [("nvidia.com/gpu", [f"{UUID1}::0"])])]),
        _pod("b", "ns", [("c", [("nvidia.com/gpu", [f"{UUID1}::1"])])]),
    ]
    provider = build_label_provider(_config(sock))
    assert provider is not None
    assert provider()[UUID1] == {"pod": "a,b", "namespace": "ns", "container": "c"}


def test_time_sliced_gpus_renamed_shared_get_pod_labels_like_mig_shares(kubelet: tuple[FakeKubelet, Path]) -> None:
    # The NVIDIA device plugin with time-slicing and renameByDefault advertises nvidia.com/gpu.shared (MIG
    # slices: nvidia.com/mig-1g.10gb.shared): the replicas' holders are named like any GPU's.
    servicer, sock = kubelet
    servicer.pods = [
        _pod("a", "ns", [("c", [("nvidia.com/gpu.shared", [f"{UUID1}::0"])])]),
        _pod("b", "ns", [("c", [("nvidia.com/gpu.shared", [f"{UUID1}::3"])])]),
        _pod("m", "ns", [("c", [("nvidia.com/mig-1g.10gb.shared", [f"{MIG0}::1"])])]),
        _pod("x", "ns", [("c", [("example.com/nic", ["eth3"])])]),
    ]
    provider = build_label_provider(_config(sock))
    assert provider is not None
    labels = provider()
    assert labels[UUID1] == {"pod": "a,b", "namespace": "ns", "container": "c"}
    assert labels[MIG0] == {"pod": "m", "namespace": "ns", "container": "c"}
    assert set(labels) == {UUID1, MIG0}


def test_results_are_cached_for_the_ttl(kubelet: tuple[FakeKubelet, Path], clock: Any) -> None:
    servicer, sock = kubelet
    servicer.pods = [_pod("p", "n", [("c", [("nvidia.com/gpu", [UUID0])])])]
    provider = build_label_provider(_config(sock), ttl_s=10.0, clock=clock)
    assert isinstance(provider, AttributionProvider)
    provider()
    provider()
    assert servicer.calls == 1
    servicer.pods = [_pod("q", "n", [("c", [("nvidia.com/gpu", [UUID0])])])]
    clock.advance(11.0)
    assert provider()[UUID0]["pod"] == "q"
    assert servicer.calls == 2


def test_kubelet_failure_is_logged_not_raised_and_last_answer_kept(
    kubelet: tuple[FakeKubelet, Path], caplog: pytest.LogCaptureFixture
) -> None:
    servicer, sock = kubelet
    servicer.pods = [_pod("p", "n", [("c", [("nvidia.com/gpu", [UUID0])])])]
    provider = build_label_provider(_config(sock), ttl_s=0.0)
    assert provider is not None
    assert provider()[UUID0]["pod"] == "p"
    servicer.fail_with = grpc.StatusCode.UNAVAILABLE
    with caplog.at_level(logging.WARNING, logger="gpuhealth.agent.attribution"):
        assert provider()[UUID0]["pod"] == "p"
        assert provider()[UUID0]["pod"] == "p"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "kubelet is restarting" in warnings[0].getMessage()


def test_dead_socket_file_does_not_raise(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A socket file left behind by a kubelet that is gone: connect fails, the provider answers {}.
    import socket as pysocket

    sock_path = short_tmp / "stale.sock"
    s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    s.bind(str(sock_path))
    s.close()
    provider = build_label_provider(_config(sock_path), ttl_s=0.0)
    assert provider is not None
    with caplog.at_level(logging.WARNING, logger="gpuhealth.agent.attribution"):
        assert provider() == {}
    assert any("failed" in r.getMessage() for r in caplog.records)


def test_no_source_on_this_node_gives_no_provider(short_tmp: Path) -> None:
    assert build_label_provider(_config(short_tmp / "absent.sock")) is None


def test_slurm_job_dir_by_uuid_and_by_index(short_tmp: Path) -> None:
    jobs = short_tmp / "jobs"
    jobs.mkdir()
    (jobs / UUID0).write_text("4242\n")
    (jobs / "1").write_text("4243\n")
    (jobs / ".2.tmp").write_text("9999\n")  # prolog's half-written file: ignored
    (jobs / "3").write_text("")  # empty: ignored
    provider = build_label_provider(_config(short_tmp / "absent.sock", jobs))
    assert provider is not None
    assert provider() == {UUID0: {"slurm_job_id": "4242"}, "1": {"slurm_job_id": "4243"}}

    translated = build_label_provider(
        _config(short_tmp / "absent.sock", jobs), index_to_uuid=lambda: {0: UUID0, 1: UUID1}
    )
    assert translated is not None
    assert translated() == {UUID0: {"slurm_job_id": "4242"}, UUID1: {"slurm_job_id": "4243"}}


def test_slurm_dir_appearing_later_and_disappearing(short_tmp: Path) -> None:
    jobs = short_tmp / "later"
    provider = build_label_provider(_config(short_tmp / "absent.sock", jobs), ttl_s=0.0)
    assert provider is not None
    assert provider() == {}
    jobs.mkdir()
    (jobs / "0").write_text("77")
    assert provider() == {"0": {"slurm_job_id": "77"}}
    os.remove(jobs / "0")
    assert provider() == {}


def test_both_sources_merge(kubelet: tuple[FakeKubelet, Path]) -> None:
    servicer, sock = kubelet
    servicer.pods = [_pod("p", "n", [("c", [("nvidia.com/gpu", [UUID0])])])]
    jobs = sock.parent / "jobs"
    jobs.mkdir()
    (jobs / UUID0).write_text("5")
    provider = build_label_provider(_config(sock, jobs))
    assert provider is not None
    assert provider()[UUID0] == {"pod": "p", "namespace": "n", "container": "c", "slurm_job_id": "5"}


@pytest.mark.parametrize(
    ("raw", "key"),
    [(UUID0, UUID0), (f"{UUID0}::3", UUID0), ("nvidia2", "2"), (MIG0, MIG0), (" 5 ", "5")],
)
def test_device_id_normalization(raw: str, key: str) -> None:
    assert normalize_device_id(raw) == key


def test_kubelet_restart_keeps_labels_for_the_grace_period_then_drops_them(
    kubelet: tuple[FakeKubelet, Path], clock: Any
) -> None:
    servicer, sock = kubelet
    servicer.pods = [_pod("p", "n", [("c", [("nvidia.com/gpu", [UUID0])])])]
    provider = build_label_provider(_config(sock), ttl_s=0.0, clock=clock)
    assert provider is not None
    assert provider()[UUID0]["pod"] == "p"
    hidden = sock.with_name("moved.sock")
    os.rename(sock, hidden)  # the kubelet is restarting: its socket is gone for a while
    clock.advance(FAILURE_GRACE_S - 1)
    assert provider()[UUID0]["pod"] == "p"  # no label flapping during a restart
    os.rename(hidden, sock)
    clock.advance(5)
    assert provider()[UUID0]["pod"] == "p"
    servicer.fail_with = grpc.StatusCode.UNAVAILABLE
    clock.advance(FAILURE_GRACE_S + 1)
    assert provider() == {}  # failing for longer than the grace: stale labels are dropped


def test_slurm_dir_removed_means_no_job_at_once(short_tmp: Path, clock: Any) -> None:
    jobs = short_tmp / "jobs"
    jobs.mkdir()
    (jobs / UUID0).write_text("9\n")
    provider = build_label_provider(_config(short_tmp / "absent.sock", jobs), ttl_s=0.0, clock=clock)
    assert provider is not None
    assert provider() == {UUID0: {"slurm_job_id": "9"}}
    (jobs / UUID0).unlink()
    jobs.rmdir()
    assert provider() == {}
