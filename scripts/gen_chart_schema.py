"""Write the gpuhealth config's JSON Schema into the Helm chart, so a typo in ``agent.config`` or
``coordinator.config`` fails when the chart renders instead of crash-looping every pod.

    .venv/bin/python scripts/gen_chart_schema.py           # rewrite definitions.gpuhealthConfig
    .venv/bin/python scripts/gen_chart_schema.py --check   # exit 1 when the chart's copy is out of date

Source: ``gpuhealth.config.json_schema()`` (the config dataclasses, their ranges and choices). Only the
``gpuhealthConfig`` definition of ``deploy/helm/gpuhealth/values.schema.json`` is written; the rest of the file is
kept as it is. ``tests/unit/deploy/test_deploy_chart_schema.py`` fails when the two differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gpuhealth.config import json_schema

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "deploy" / "helm" / "gpuhealth" / "values.schema.json"
KEY = '"gpuhealthConfig":'
INDENT = 4  # where the definition sits in the file: {"definitions": {"gpuhealthConfig": ...}}


def render(text: str, schema: dict[str, Any]) -> str:
    """``text`` (the chart's values.schema.json) with its gpuhealthConfig definition replaced by ``schema``."""
    at = text.find(KEY)
    if at < 0:
        raise SystemExit(f"{SCHEMA}: no {KEY} definition to replace")
    start = at + len(KEY)
    while text[start] in " \n":
        start += 1
    _, end = json.JSONDecoder().raw_decode(text, start)
    return text[:start] + _compact(schema) + text[end:]


def _compact(schema: dict[str, Any]) -> str:
    """The schema one key a line (a new config key is a one-line diff)."""
    pad = " " * INDENT
    sections = []
    for name, section in schema["properties"].items():
        keys = ",\n".join(f'{pad}      {json.dumps(k)}: {json.dumps(v)}' for k, v in section["properties"].items())
        head = {k: v for k, v in section.items() if k != "properties"}
        sections.append(f'{pad}    {json.dumps(name)}: {json.dumps(head)[:-1]}, "properties": {{\n{keys}}}}}')
    head = {k: v for k, v in schema.items() if k != "properties"}
    return f'{json.dumps(head)[:-1]}, "properties": {{\n' + ",\n".join(sections) + "}}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the chart's schema is out of date")
    args = parser.parse_args(argv)
    text = SCHEMA.read_text()
    new = render(text, json_schema())
    json.loads(new)  # still one JSON document
    if args.check:
        if new != text:
            print(f"{SCHEMA.relative_to(REPO)} is out of date: run scripts/gen_chart_schema.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        SCHEMA.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
