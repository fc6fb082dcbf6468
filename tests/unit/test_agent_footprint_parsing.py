"""The footprint benchmark's readers (``benchmarks/agent_footprint.py``): /proc, smaps, -X importtime, py-spy."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import agent_footprint as fp  # noqa: E402


def test_stat_with_a_name_holding_spaces_and_parentheses() -> None:
    line = "4242 (gh-c (odd) x) S 1 4242 4242 0 -1 4194368 100 0 0 0 37 12 0 0 20 0 23 0 555 0 0\n"
    assert fp.parse_stat(line) == ("gh-c (odd) x", 49)


def test_status_numbers_and_schedstat() -> None:
    text = ("Name:\tgh-http\nState:\tS (sleeping)\nVmRSS:\t   38276 kB\nRssAnon:\t   27128 kB\nRssFile:\t   11148 kB\n"
            "voluntary_ctxt_switches:\t22\nnonvoluntary_ctxt_switches:\t8\nCpus_allowed_list:\t0-1\n")
    st = fp.parse_status(text)
    assert (st["RssAnon"], st["RssFile"], st["voluntary_ctxt_switches"], st["nonvoluntary_ctxt_switches"]) == (
        27128, 11148, 22, 8)
    assert "Name" not in st and "Cpus_allowed_list" not in st
    assert fp.parse_schedstat("123456789 2000 17\n") == 123456789


def test_smaps_sums_rss_per_mapping_and_names_anonymous_ones() -> None:
    text = """55e0c0000000-55e0c0100000 r--p 00000000 08:01 123  /usr/bin/python3.11
Size:               1024 kB
Rss:                 800 kB
55e0c0100000-55e0c0200000 r-xp 00100000 08:01 123  /usr/bin/python3.11
Rss:                 200 kB
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
Rss:                 300 kB
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
Rss:                  12 kB
VmFlags: rd wr mr mw me gd ac
"""
    assert fp.parse_smaps(text) == {"/usr/bin/python3.11": 1000, "[anon]": 300, "[stack]": 12}


def test_importtime_lines() -> None:
    lines = ["import time: self [us] | cumulative | imported package", "import time:       307 |      17576 |   click",
             "import time:        21 |         21 |     click._compat", "2026-12-08 agent started"]
    assert fp.parse_importtime(lines) == [("click", 307, 17576), ("click._compat", 21, 21)]


def test_pyspy_dump_threads_and_raw_profile() -> None:
    dump = ('Process 14452: python -m gpuhealth.cli.main agent\nThread 14452 (idle): "MainThread"\n'
            '    wait (threading.py:324)\nThread 14455 (active): "gpuhealth-http-0"\n')
    assert fp.parse_pyspy_threads(dump) == {14452: "MainThread", 14455: "gpuhealth-http-0"}
    raw = ('process 1:"python agent";thread (0x1): gpuhealth-xid-events;_loop (xid.py:289);wait (threading.py:324) 4\n'
           'process 1:"python agent";thread (0x2): gpuhealth-http;_loop (http.py:267);select (selectors.py:468) 3\n'
           'process 1:"python agent";thread (0x1): gpuhealth-xid-events;_loop (xid.py:289);wait (threading.py:330) 1\n'
           "garbage\n")
    leaves, threads, total = fp.parse_pyspy_raw(raw)
    assert total == 8
    assert leaves == {"wait (threading.py)": 5, "select (selectors.py)": 3}
    assert threads == {"thread (0x1): gpuhealth-xid-events": 5, "thread (0x2): gpuhealth-http": 3}


def test_scenario_lists_each_rank_on_its_own_gpu() -> None:
    jobs = [fp.Job("a", None, Path("x"), pids={0: 11, 1: 12}), fp.Job("b", None, Path("y"), pids={0: 21, 1: 22})]  # type: ignore[arg-type]
    text = fp.scenario_for(jobs)
    import yaml

    doc = yaml.safe_load(text)
    assert doc["gpu_count"] == 8
    assert {g: [e["pid"] for e in v["ComputeRunningProcesses"]] for g, v in doc["overrides"].items()} == {
        "0": [11], "1": [12], "2": [21], "3": [22]}
    assert "overrides" not in yaml.safe_load(fp.scenario_for([]))


def test_a_process_tree_is_sampled_per_thread_with_its_children() -> None:
    stop = threading.Event()
    t = threading.Thread(target=lambda: stop.wait(5), name="waiter")
    t.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while child.pid not in fp.tree_pids(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in fp.tree_pids(os.getpid())
        tasks = fp.sample_tasks([os.getpid()])
        assert (os.getpid(), t.native_id) in tasks and tasks[(os.getpid(), os.getpid())].cpu_ns > 0
        mem = fp.memory_kb([os.getpid(), child.pid])
        assert mem["VmRSS"] >= mem["RssAnon"] > 0 and mem["RssFile"] > 0
    finally:
        stop.set()
        t.join()
        child.kill()
        child.wait()
