"""``python -m gpuhealth.diag …``: the diagnostics child process (see ``child.py``)."""

from __future__ import annotations

import sys

from gpuhealth.diag.child import main

if __name__ == "__main__":
    sys.exit(main())
