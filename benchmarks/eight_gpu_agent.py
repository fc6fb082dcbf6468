"""A real agent (in this process, every collector) on 8 H200s cloned from the bundled real recording, after
two passes of every collector so rates and history are filled in: its export snapshot. Shared by the
benchmarks that measure what the agent renders."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

SCENARIO = "recording: nvml_h200x2.json\ngpu_count: 8\n"


def warm_snapshot() -> Any:
    from gpuhealth.agent.daemon import Agent
    from gpuhealth.backends.nvml_fake import FakeNvml
    from gpuhealth.config import Config
    from gpuhealth.runtime.sdnotify import SystemdNotifier

    work = Path(tempfile.mkdtemp(prefix="gpuhealth-bench-"))
    (work / "eight.yaml").write_text(SCENARIO)
    cfg = Config()
    cfg.agent.pod_resources_socket = str(work / "none.sock")
    cfg.collectors.fast_interval_s, cfg.collectors.slow_interval_s = 0.2, 0.4
    agent = Agent(cfg, FakeNvml.from_file(work / "eight.yaml"), serve_http=False, extensions=[],
                  notifier=SystemdNotifier(env={}))
    agent.start()
    try:
        deadline = time.monotonic() + 30
        while not agent.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # a second pass of every collector: rates and history filled in
        return agent.snapshot()
    finally:
        agent.stop()
