"""NVML errors as plain data, so the fake and the real backend raise the same thing."""

from __future__ import annotations

# NVML return codes we act on (nvml.h). Keep the numbers: recordings store them.
SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
IRQ_ISSUE = 11
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
CORRUPTED_INFOROM = 14
GPU_IS_LOST = 15
RESET_REQUIRED = 16
UNKNOWN = 999

# Codes that mean "this GPU cannot answer anything any more" (fell off the bus, needs reset).
GPU_GONE_CODES = frozenset({GPU_IS_LOST, RESET_REQUIRED})
# Codes that mean the driver/library as a whole is unusable: re-initialise NVML.
DRIVER_GONE_CODES = frozenset({UNINITIALIZED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND})


class NvmlError(Exception):
    """An NVML call failed with ``code``. "Not Supported" is a normal answer: see ``not_supported``."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message or f"NVML error {code}")
        self.code = code
        self.message = message or f"NVML error {code}"

    @property
    def not_supported(self) -> bool:
        return self.code in (NOT_SUPPORTED, FUNCTION_NOT_FOUND)

    @property
    def gpu_gone(self) -> bool:
        return self.code in GPU_GONE_CODES

    @property
    def driver_gone(self) -> bool:
        return self.code in DRIVER_GONE_CODES

    def __reduce__(self) -> tuple[type[NvmlError], tuple[int, str]]:
        return (NvmlError, (self.code, self.message))


class BackendUnavailable(Exception):
    """No driver, no libnvidia-ml, or no bindings: the backend cannot start at all."""


class RecordingError(ValueError):
    """A recording or scenario file is malformed; the message names the file and the key."""
