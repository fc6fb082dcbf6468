"""Golden digest store: keyed by environment, never silently rewritten, shareable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuhealth.diag.golden import GoldenError, GoldenStore, key_id

KEY = {"device": "NVIDIA H100 80GB HBM3", "sm_count": 132, "driver": "580.159.04", "cuda": "13.0",
       "torch": "2.11.0", "flags": {"allow_tf32": False}, "seed": 1, "hash": "v1"}


def test_key_id_is_stable_and_sensitive_to_every_field() -> None:
    assert key_id(KEY) == key_id(dict(reversed(list(KEY.items()))))
    for field in KEY:
        changed = {**KEY, field: "other"}
        assert key_id(changed) != key_id(KEY), field


def test_record_load_and_refuse_to_rewrite(tmp_path: Path) -> None:
    store = GoldenStore(tmp_path / "golden")
    assert store.load(KEY) is None
    store.record(KEY, {"a": "1"}, source="test")
    store.record(KEY, {"b": "2"}, source="test")  # adding cases is fine
    assert store.load(KEY) == {"a": "1", "b": "2"}
    with pytest.raises(GoldenError, match="would change"):
        store.record(KEY, {"a": "9"}, source="test")
    assert store.load(KEY) == {"a": "1", "b": "2"}
    store.record(KEY, {"a": "9"}, source="test", replace=True)
    assert store.load(KEY)["a"] == "9"
    assert store.load({**KEY, "sm_count": 114}) is None  # another SM count is another golden


def test_export_import_round_trip_and_conflicts(tmp_path: Path) -> None:
    a = GoldenStore(tmp_path / "a")
    a.record(KEY, {"x": "1", "y": "2"}, source="node-a")
    bundle = tmp_path / "bundle.json"
    assert a.export(bundle) == 1
    b = GoldenStore(tmp_path / "b")
    assert b.import_bundle(bundle) == 1
    assert b.load(KEY) == {"x": "1", "y": "2"}
    c = GoldenStore(tmp_path / "c")
    c.record(KEY, {"x": "other"}, source="node-c")
    with pytest.raises(GoldenError, match="contradicts"):
        c.import_bundle(bundle)
    assert c.load(KEY) == {"x": "other"}  # nothing written on a refused import


@pytest.mark.parametrize("content", ["not json", json.dumps({"format": "nope"}), json.dumps([1, 2])])
def test_bad_bundles_are_clear_errors(tmp_path: Path, content: str) -> None:
    p = tmp_path / "b.json"
    p.write_text(content)
    with pytest.raises(GoldenError):
        GoldenStore(tmp_path / "g").import_bundle(p)


def test_a_corrupt_golden_file_is_a_clear_error(tmp_path: Path) -> None:
    store = GoldenStore(tmp_path)
    store.path_for(KEY).write_text("{broken")
    with pytest.raises(GoldenError, match="not valid JSON"):
        store.load(KEY)


def test_merge_from_an_old_place_adds_cases_keeps_both_and_refuses_contradictions(tmp_path: Path) -> None:
    old, new = GoldenStore(tmp_path / "old"), GoldenStore(tmp_path / "new")
    other = {**KEY, "sm_count": 114}
    old.record(KEY, {"a": "1", "b": "2"}, source="cache")
    old.record(other, {"a": "7"}, source="cache")
    new.record(KEY, {"a": "1"}, source="here")
    merged, problems = new.merge_from(old)
    assert sorted(merged) == sorted([key_id(KEY), key_id(other)]) and problems == []
    assert new.load(KEY) == {"a": "1", "b": "2"} and new.load(other) == {"a": "7"}
    assert old.load(KEY) == {"a": "1", "b": "2"}  # the old copy is kept
    assert new.merge_from(old) == ([], [])  # nothing new: nothing rewritten
    old.record(KEY, {"c": "3"}, source="cache")
    GoldenStore(tmp_path / "new").record(KEY, {"c": "4"}, source="here")
    merged, problems = new.merge_from(old)
    assert merged == [] and len(problems) == 1 and "contradicts" in problems[0] and "['c']" in problems[0]
    assert new.load(KEY)["c"] == "4"  # never overwritten
