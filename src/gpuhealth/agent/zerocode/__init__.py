"""Zero-code debugging: the agent finds, watches and triages PyTorch/NCCL jobs that import nothing of ours.

- ``discovery``: NVML's compute processes + ``/proc/<pid>/environ`` → jobs and ranks (``environ``).
- ``ras``: a client for NCCL's RAS service (``localhost:28028``) and its two report formats.
- ``hang``: counts that stop advancing with a rank behind → a verdict naming the rank.
- ``fifo`` (+ ``rootfs``): a live rank's flight-recorder dump through its FIFO, inside its own root.
- ``stacks``: py-spy; ``evidence``: dumps + stacks + triage (in a child process) for one job.
- ``watcher``: the agent extension tying them together; ``ranksource``: discovered ranks for the
  coordinator's requests, beside the instrumented ones.

What works with no configuration, what needs the launch variables and what needs root: docs/zero-code.md.
"""
