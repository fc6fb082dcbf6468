"""The streaming JSON reader gives exactly what ``json.loads`` gives: on every committed dump, in
any layout, and on generated documents; a document cut short is a syntax error, nothing else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from frbuild import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuhealth.flightrec.jsonstream import NOT_AN_OBJECT, DumpReader, JsonBoundsError, JsonSyntaxError
from gpuhealth.flightrec.load import load_dumps
from gpuhealth.flightrec.normalize import entry_slow

KEEP = {"version", "comm_lib_version", "nccl_version", "pg_config", "pg_status", "rank", "host", "gpuhealth",
        "dump_time_ns"}


def _stream(data: bytes) -> tuple[dict[str, Any], list[Any], str]:
    reader = DumpReader(data, KEEP)
    items = list(reader.entries())
    return reader.blocks, items, reader.entries_kind


def _committed_dumps() -> list[Path]:
    return [p for p in sorted(FIXTURES.rglob("*.json")) if "entries" in json.loads(p.read_bytes())]


def test_every_committed_json_dump_streams_and_loads_like_json_loads(tmp_path: Path) -> None:
    paths = _committed_dumps()
    assert len(paths) >= 20
    for path in paths:
        doc = json.loads(path.read_bytes())
        layouts = {
            "as written": path.read_bytes(),
            "indented": json.dumps(doc, indent=2).encode(),
            "spaced": json.dumps(doc, separators=(" , ", " : ")).encode(),
        }
        for layout, data in layouts.items():
            blocks, items, kind = _stream(data)
            assert items == doc["entries"], (path, layout)
            assert blocks == {k: v for k, v in doc.items() if k in KEEP}, (path, layout)
            assert kind == "array"
        # The loader's records are those of json.loads + the careful per-field reader.
        copy = tmp_path / path.relative_to(FIXTURES)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(layouts["indented"])
        for source in (path, copy):
            loaded = load_dumps(source)
            assert not loaded.problems, loaded.problems
            (dump,) = loaded.dumps.values()
            assert dump.entries == sorted((entry_slow(e) for e in doc["entries"]), key=lambda e: e.record_id)


_SCALAR = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
           | st.text(alphabet=st.sampled_from('ab{}[]",:\\ é\n\t€𝄞'), max_size=8))
_JSONISH = st.recursive(_SCALAR, lambda kids: st.lists(kids, max_size=4)
                        | st.dictionaries(st.text(alphabet='ab{}"\\', max_size=4), kids, max_size=4), max_leaves=16)


@settings(max_examples=300, deadline=None)
@given(
    top=st.dictionaries(st.sampled_from(sorted(KEEP | {"nccl_comm_state", "x{\"", "y"})), _JSONISH, max_size=6),
    entries=st.one_of(st.lists(st.dictionaries(st.text(max_size=6), _JSONISH, max_size=5) | _JSONISH, max_size=6),
                      _JSONISH, st.none()),
    layout=st.sampled_from([{}, {"indent": 1}, {"separators": (",", ":")}, {"separators": (" ,\n", " :\t")},
                            {"ensure_ascii": False}]),
    cut=st.floats(min_value=0.0, max_value=1.0),
)
def test_generated_documents_stream_like_json_loads(top: dict[str, Any], entries: Any, layout: dict[str, Any],
                                                    cut: float) -> None:
    doc = dict(top)
    if entries is not None:
        doc["entries"] = entries
    data = json.dumps(doc, **layout).encode()
    blocks, items, kind = _stream(data)
    assert blocks == {k: v for k, v in doc.items() if k in KEEP}
    if isinstance(entries, list):
        assert kind == "array"
        assert items == [e if isinstance(e, dict) else NOT_AN_OBJECT for e in entries]
    else:
        assert items == []
        assert kind == ("absent" if entries is None else {dict: "object", str: "string", bool: "boolean",
                                                          type(None): "null"}.get(type(entries), "number"))
    short = data[: int(len(data) * cut)]
    if short.strip() != data.strip():
        with pytest.raises((JsonSyntaxError, JsonBoundsError)):
            _stream(short)
