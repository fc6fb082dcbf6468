"""The cluster in one box leaves nothing behind: not when the body of its ``with`` fails, and not when the process
that made it is killed with SIGKILL (its agents and coordinator die with it; the next cluster removes its
namespaces, veths and bridge). Traffic stays on the bridge: a node has no route beyond its /24."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cluster import PREFIX, Cluster, available, remove_stale, sh

pytestmark = pytest.mark.skipif(available() is not None, reason=f"cluster in one box: {available()}")


def _names(prefix: str) -> list[str]:
    netns = [ln.split()[0] for ln in sh("ip", "netns", "list").stdout.splitlines() if ln.startswith(prefix)]
    links = [ln.split(":")[1].strip().split("@")[0] for ln in sh("ip", "-o", "link", "show").stdout.splitlines()
             if ln.split(":")[1].strip().startswith(prefix)]
    return netns + links


def _running(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if marker in ln and "ps -eo" not in ln]


def test_a_failing_body_leaves_nothing_and_nodes_have_no_route_out(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="the test failed"), Cluster(tmp_path / "c", nodes=2) as c:
        prefix = c.prefix
        routes = sh("ip", "route", ns=c.nodes[0].ns).stdout
        assert "default" not in routes and routes.strip().startswith(f"{c.net}.0/24"), routes
        assert _names(prefix) and _running(str(tmp_path / "c"))
        raise RuntimeError("the test failed")
    assert _names(prefix) == [] and _running(str(tmp_path / "c")) == []


def test_a_killed_run_leaves_no_process_and_the_next_one_removes_its_network(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from cluster import Cluster
        c = Cluster(Path({str(tmp_path / "k")!r}), nodes=2)
        c.start()
        print(c.prefix, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no atexit
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                         env={**os.environ})
    assert res.returncode == -9, res.stderr
    prefix = res.stdout.split()[0]
    assert prefix.startswith(PREFIX)
    deadline = time.monotonic() + 20
    while _running(str(tmp_path / "k")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(str(tmp_path / "k")) == []  # agents and coordinator died with their parent
    assert _names(prefix)  # its network is still there ...
    removed = remove_stale()
    assert _names(prefix) == [] and set(removed) >= {f"{prefix}n0", f"{prefix}n1", f"{prefix}b"}  # ... until now
