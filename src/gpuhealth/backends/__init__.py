"""GPU access behind a narrow protocol (see ``base.NvmlBackend``), plus kernel-log and sysfs readers."""
