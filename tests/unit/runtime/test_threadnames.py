"""Thread names in the kernel: what ``top -H`` and ``/proc/<pid>/task/<tid>/comm`` show for the agent's threads."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from gpuhealth.runtime import threadnames


def test_long_names_are_shortened_to_what_the_kernel_keeps() -> None:
    assert threadnames.kernel_name("gpuhealth-collector-telemetry") == "gh-c-telemetry"
    assert threadnames.kernel_name("gpuhealth-collector-infiniband") == "gh-c-infiniband"
    assert threadnames.kernel_name("gpuhealth-http-0") == "gh-http-0"
    assert threadnames.kernel_name("ThreadPoolExecutor-0_1") == "pool-0_1"
    assert len(threadnames.kernel_name("x" * 40).encode()) == 15
    assert threadnames.kernel_name("é" * 10) == "é" * 7  # never half a character


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_NAME is Linux's")
def test_threads_started_after_install_carry_their_python_name_in_the_kernel() -> None:
    main_comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()
    try:
        assert threadnames.install()
        seen: dict[str, str] = {}

        def body() -> None:
            seen["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
            seen["profile"] = repr(sys.getprofile())

        t = threading.Thread(target=body, name="gpuhealth-collector-telemetry")
        t.start()
        t.join()
        assert seen == {"comm": "gh-c-telemetry", "profile": "None"}  # named, and the hook is gone
        # the process keeps its name (ps, pgrep)
        assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text() == main_comm
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
