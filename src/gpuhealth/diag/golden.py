"""Golden SDC digests: one JSON file per environment key under ``config.diag.golden_dir``.

The key names everything that may legitimately change a matmul's bits (GPU model, SM count, driver,
CUDA, cuBLAS and torch versions, math flags, seed, hash version). Files are written atomically and
can be exported to one bundle and imported on other nodes, so a fleet shares one reference instead
of each GPU trusting itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BUNDLE_FORMAT = "gpuhealth-golden-v1"


class GoldenError(ValueError):
    """A golden file or bundle that cannot be read, or an import that contradicts what is stored."""


def key_id(key: Mapping[str, Any]) -> str:
    canonical = json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def _atomic_write(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class GoldenStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def path_for(self, key: Mapping[str, Any]) -> Path:
        return self.directory / f"{key_id(key)}.json"

    def _read(self, path: Path) -> dict[str, Any]:
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise GoldenError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise GoldenError(f"{path}: not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("digests"), dict) or "key" not in data:
            raise GoldenError(f"{path}: not a golden digest file (needs 'key' and 'digests')")
        return data

    def load(self, key: Mapping[str, Any]) -> dict[str, str] | None:
        path = self.path_for(key)
        if not path.exists():
            return None
        return {str(k): str(v) for k, v in self._read(path)["digests"].items()}

    def record(self, key: Mapping[str, Any], digests: Mapping[str, str], *, source: str,
               replace: bool = False) -> Path:
        """Add digests for ``key``. A case already stored with a different digest is an error
        unless ``replace``: a golden is never silently rewritten."""
        path = self.path_for(key)
        current = self._read(path)["digests"] if path.exists() else {}
        if not replace:
            clash = {c: (current[c], d) for c, d in digests.items() if c in current and current[c] != d}
            if clash:
                raise GoldenError(f"{path}: would change the golden digest of {sorted(clash)}")
        merged = {**current, **digests}
        _atomic_write(path, {"key": dict(key), "key_id": key_id(key), "digests": merged,
                             "recorded_at": time.time(), "source": source})
        return path

    def merge_from(self, other: GoldenStore) -> tuple[list[str], list[str]]:
        """Copy ``other``'s goldens in, case by case; ``other`` is left as it is. Returns (key ids that gained
        cases, one line per key that could not come: a case whose digest contradicts this store's — kept here,
        never overwritten — or a file that cannot be read). Idempotent: what is already here is not rewritten."""
        merged: list[str] = []
        problems: list[str] = []
        if not other.directory.is_dir():
            return merged, problems
        for path in sorted(other.directory.glob("*.json")):
            try:
                entry = other._read(path)
                key = entry["key"]
                digests = {str(k): str(v) for k, v in entry["digests"].items()}
                stored = self.load(key) or {}
            except (GoldenError, TypeError, AttributeError) as exc:
                problems.append(f"{path}: not merged: {exc}")
                continue
            clash = sorted(c for c, d in digests.items() if c in stored and stored[c] != d)
            if clash:
                problems.append(f"{path}: not merged: contradicts {self.path_for(key)} for {clash}")
                continue
            if any(c not in stored for c in digests):
                self.record(key, digests, source=str(entry.get("source") or f"merged from {other.directory}"))
                merged.append(key_id(key))
        return merged, problems

    def entries(self) -> list[dict[str, Any]]:
        if not self.directory.is_dir():
            return []
        return [self._read(p) for p in sorted(self.directory.glob("*.json"))]

    def export(self, path: str | Path) -> int:
        entries = self.entries()
        _atomic_write(Path(path), {"format": BUNDLE_FORMAT, "entries": entries})
        return len(entries)

    def import_bundle(self, path: str | Path, *, replace: bool = False) -> int:
        """Merge a bundle written by ``export``; returns how many keys it held. Contradictions with
        stored digests are refused (nothing is written) unless ``replace``."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except OSError as exc:
            raise GoldenError(f"{p}: cannot read: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise GoldenError(f"{p}: not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT or not isinstance(
                data.get("entries"), list):
            raise GoldenError(f"{p}: not a golden bundle (format {BUNDLE_FORMAT!r})")
        entries = data["entries"]
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("key"), dict) or not isinstance(
                    entry.get("digests"), dict):
                raise GoldenError(f"{p}: entry {i} needs 'key' and 'digests'")
            if not replace:
                stored = self.load(entry["key"]) or {}
                clash = sorted(c for c, d in entry["digests"].items() if c in stored and stored[c] != d)
                if clash:
                    raise GoldenError(f"{p}: entry {i} contradicts stored golden digests for {clash}")
        for entry in entries:
            self.record(entry["key"], {str(k): str(v) for k, v in entry["digests"].items()},
                        source=f"import:{p.name}", replace=replace)
        return len(entries)
