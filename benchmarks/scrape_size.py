"""What one ``/metrics`` scrape of an 8-GPU node weighs: series and bytes, plain and gzipped (as the
agent's HTTP server sends it to a scraper that accepts gzip), with NVLink per GPU (the default) and
per link (``nvlink_per_link``, what every scrape was before), with and without ``--dcgm-compat``.

A real agent (in this process, every collector, two passes so rates and history are filled in) on
8 H200s cloned from the bundled real recording; the render is the endpoint's own.

    .venv/bin/python benchmarks/scrape_size.py [--json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
from typing import Any

from eight_gpu_agent import warm_snapshot


def measure() -> list[dict[str, Any]]:
    from gpuhealth.agent.http import GZIP_LEVEL
    from gpuhealth.exporters.prometheus import MetricsEndpoint

    snap = warm_snapshot()
    rows = []
    for per_link in (True, False):
        for compat in (False, True):
            endpoint = MetricsEndpoint(lambda: snap, dcgm_compat=compat, nvlink_per_link=per_link)
            body, _ = endpoint.render(None)
            series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
            rows.append({"nvlink": "per link" if per_link else "per GPU", "dcgm_compat": compat, "series": series,
                         "bytes": len(body), "gzip_bytes": len(gzip.compress(body, compresslevel=GZIP_LEVEL))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    from gpuhealth.agent.http import GZIP_LEVEL

    rows = measure()
    if args.json:
        print(json.dumps({"host": platform.node(), "python": platform.python_version(), "rows": rows}, indent=2))
        return
    print(f"| NVLink series | --dcgm-compat | series | bytes | gzip (level {GZIP_LEVEL}) |")
    print("|---|---|---|---|---|")
    for r in rows:
        compat = "yes" if r["dcgm_compat"] else "no"
        print(f"| {r['nvlink']} | {compat} | {r['series']:,} | {r['bytes'] / 1024:,.0f} KiB "
              f"| {r['gzip_bytes'] / 1024:,.1f} KiB |")


if __name__ == "__main__":
    main()
