"""``python -m gpuhealth.diag …``: the diagnostics child process (see ``child.py``)."""

from __future__ import annotations

import os
import sys

from gpuhealth.diag.child import main

if __name__ == "__main__":
    code = main()
    # The result is printed and every file is closed: skip interpreter finalization. torch's process
    # groups freed there can abort the process (seen with Gloo: "terminate called without an active
    # exception" after all work was done) or hang, and the launcher counts any rank's bad exit as a
    # failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
