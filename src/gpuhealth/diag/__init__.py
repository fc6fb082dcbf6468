"""Diagnostics: SDC matmul hashing, collective bus bandwidth, memory bandwidth, node qualification.

The agent and the CLI import only the torch-free modules (``runner``, ``qualify``, ``golden``,
``compare``); everything that needs torch runs in the child process ``python -m gpuhealth.diag``.
"""
