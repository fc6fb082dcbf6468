"""What ``status`` and ``qualify`` both start from: the config (file + flags) and a GPU backend (live
NVML, or a recording/scenario). Every way this can fail becomes one ``NodeInputError`` line."""

from __future__ import annotations

from gpuhealth.backends.base import NvmlBackend
from gpuhealth.backends.errors import BackendUnavailable, NvmlError, RecordingError
from gpuhealth.cli._usage import flag_error
from gpuhealth.config import Config, ConfigError, FlagError, load_config
from gpuhealth.node import make_backend


class NodeInputError(Exception):
    """The node cannot be checked at all (exit code: the profile's "unknown"). ``driver``: because the
    NVIDIA driver / NVML is not there or not answering (not a bad file or flag)."""

    def __init__(self, message: str, *, driver: bool = False, backend: NvmlBackend | None = None) -> None:
        super().__init__(message)
        self.driver = driver
        self.backend = backend  # the backend that would not start (a replay still says what host it records)


def open_node(config_path: str | None, snapshot: str | None, kmsg_path: str | None,
              expected_gpus: int | None) -> tuple[Config, NvmlBackend]:
    try:
        config = load_config(config_path, overrides={
            "collectors": {"expected_gpus": expected_gpus, "kmsg_path": kmsg_path},
            "agent": {"nvml_snapshot": snapshot},
        })
    except FlagError as exc:  # a usage error (64), not a node that could not be checked
        raise flag_error(exc, {"collectors.expected_gpus": "--expected-gpus", "collectors.kmsg_path": "--kmsg",
                               "agent.nvml_snapshot": "--nvml-snapshot"}) from None
    except ConfigError as exc:
        raise NodeInputError(str(exc)) from exc
    try:
        backend = make_backend(config.agent.nvml_snapshot)
    except RecordingError as exc:
        raise NodeInputError(f"bad recording: {exc}") from exc
    try:
        backend.init()
    except BackendUnavailable as exc:
        raise NodeInputError(f"{exc} — cannot check GPUs here (try --nvml-snapshot FILE for a recording)",
                             driver=True, backend=backend) from exc
    except NvmlError as exc:
        raise NodeInputError(f"NVML failed to start: {exc.message} (code {exc.code})", driver=True,
                             backend=backend) from exc
    return config, backend
