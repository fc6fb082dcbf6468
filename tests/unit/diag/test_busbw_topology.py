"""The busbw reference a node is judged against comes from its NVLinks as NVML reports them: the
recorded 2 × H200 VM guest (NVLink 4.0 to the host's NVSwitches) is ``nvlink``; layouts the built-in
curves were not measured on get a name of their own and are never judged against them (a false drain)."""

from __future__ import annotations

from typing import Any

from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.diag import busbw
from gpuhealth.diag.topology import classify, detect

LINKS = range(18)


def _node(per_gpu: dict[int, dict[int, dict[str, Any]]] | None = None, recording: str = "nvml_h200x2.json") -> FakeNvml:
    overrides = {str(g): {"nvlink": {str(link): v for link, v in links.items()}}
                 for g, links in (per_gpu or {}).items()}
    backend = FakeNvml.from_scenario({"recording": recording, "overrides": overrides})
    backend.init()
    return backend


def _all_links(**reading: Any) -> dict[int, dict[str, Any]]:
    return {link: dict(reading) for link in LINKS}


def test_the_recorded_vm_guest_is_the_curves_own_topology() -> None:
    topo = detect(_node(), world=2)
    assert topo.name == "nvlink", topo
    assert "NVSwitch" in topo.why


def test_a_gpu_without_nvlink_is_pcie() -> None:
    assert detect(_node(recording="nvml_h100x1.json"), world=1).name == "pcie"
    assert detect(_node({0: _all_links(state=0), 1: _all_links(state=0)}), world=2).name == "pcie"


def test_bridged_or_meshed_gpus_are_not_judged_as_nvswitch() -> None:
    direct = _node({0: _all_links(remote_type=0), 1: _all_links(remote_type=0)})
    assert detect(direct, world=2).name == "nvlink-direct"


def test_another_nvlink_generation_through_switches_has_its_own_name() -> None:
    a100 = _node({0: _all_links(version=4), 1: _all_links(version=4)})  # NVML_NVLINK_VERSION_3_0: A100
    assert detect(a100, world=2).name == "nvswitch-nvlink3"
    b200 = _node({0: _all_links(version=7), 1: _all_links(version=7)})
    assert detect(b200, world=2).name == "nvswitch-nvlink5"


def test_one_gpu_without_links_makes_the_group_partial() -> None:
    assert detect(_node({1: _all_links(state=0)}), world=2).name == "nvlink-partial"


def test_remote_type_not_said_needs_the_sxm_link_count() -> None:
    unsaid = {"error": "Not Supported", "code": 3}
    full = _node({0: _all_links(remote_type=unsaid), 1: _all_links(remote_type=unsaid)})
    assert detect(full, world=2).name == "nvlink"
    twelve = {link: {"remote_type": unsaid, **({"state": 0} if link >= 12 else {})} for link in LINKS}
    assert detect(_node({0: twelve, 1: twelve}), world=2).name == "unknown"  # an NVL card's 12 links


def test_only_the_curves_topology_is_judged() -> None:
    """A healthy 8 × H100 NVL node (pairs bridged, the rest over PCIe) reads ~30 GB/s all_reduce: against
    the NVSwitch curve that was a critical drain; under its own topology it is unjudged (info)."""
    point = busbw.make_point("all_reduce", 1 << 30, 8, seconds=(1 << 30) * 2 * 7 / 8 / 30e9, errors=0, graph=False)
    drained, _ = busbw.judge([point], topology="nvlink", node="n")
    assert [(f.code, str(f.severity)) for f in drained] == [("busbw.low", "critical")]
    info, summary = busbw.judge([point], topology="nvlink-direct", node="n")
    assert [(f.code, str(f.severity)) for f in info] == [("busbw.unjudged", "info")]
    assert summary["unjudged"] == ["all_reduce"]


def test_classify_says_why() -> None:
    assert classify([]).name == "unknown"


def test_gloo_and_multinode_runs_are_named_without_nvml() -> None:
    assert busbw.detect_topology(2, False, cuda=False) == "cpu"
    assert busbw.detect_topology(2, True, cuda=True) == "multinode"


def test_a_switch_board_with_fewer_links_per_gpu_is_not_judged_as_sxm5() -> None:
    """H800: 8 NVLink 4.0 links to NVSwitches — under half the H100/H200 curve by design."""
    absent = {"error": "Not Supported", "code": 3}
    eight = {link: {"state": absent, "version": absent, "remote_type": absent} for link in range(8, 18)}
    topo = detect(_node({0: eight, 1: eight}), world=2)
    assert topo.name == "nvswitch-nvlink4-links8", topo


def test_one_link_down_on_an_sxm5_gpu_is_still_judged() -> None:
    # A real fault (17 of 18 links up): still the curves' topology, so its lower bandwidth is judged.
    assert detect(_node({0: {5: {"state": 0}}}), world=2).name == "nvlink"


def test_a_remote_type_nvml_calls_unknown_is_not_a_gpu() -> None:
    unknown = _node({0: _all_links(remote_type=0xFF), 1: _all_links(remote_type=0xFF)})
    assert detect(unknown, world=2).name == "nvlink"  # 18 active 4.0 links: the SXM5 board


def test_the_ranks_gpus_are_the_visible_ones() -> None:
    """The diag runner hands a busbw run CUDA_VISIBLE_DEVICES as NVML indices: the topology is theirs."""
    node = _node({0: _all_links(state=0)})  # GPU 0 has no NVLink, GPU 1 is on the switches
    assert detect(node, world=1, visible="1").name == "nvlink"
    assert detect(node, world=1, visible="0").name == "pcie"
    uuid = str(node.query(1, "UUID"))
    assert detect(node, world=1, visible=uuid).name == "nvlink"
    assert detect(node, world=1, visible="GPU-not-here").name == "unknown"
