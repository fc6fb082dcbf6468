"""Wording shared by the analyser's findings: compact rank lists and ordinals."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def format_ranks(ranks: Iterable[int], max_chars: int = 100) -> str:
    """Compact rank list for people: "0-3,7,9-12", "5-1021 every 8th (128 ranks)", or a cut list
    with the count when it would be long (evidence keeps the full list)."""
    rs = sorted(set(ranks))
    if len(rs) >= 4:
        stride = Counter(b - a for a, b in itertools.pairwise(rs)).most_common(1)[0][0]
        if stride > 1 and all((r - rs[0]) % stride == 0 for r in rs):
            gaps = sorted(set(range(rs[0], rs[-1] + 1, stride)) - set(rs))
            if len(gaps) <= 3:
                every = f"{rs[0]}-{rs[-1]} every {ordinal(stride)}"
                if gaps:
                    every += " except " + ",".join(map(str, gaps))
                return f"{every} ({len(rs)} ranks)"
    parts = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    text = ",".join(parts)
    if len(text) <= max_chars:
        return text
    shown, used = [], 0
    for part in parts:
        if used + len(part) + 1 > max_chars - 20:
            break
        shown.append(part)
        used += len(part) + 1
    return ",".join(shown) + f",… ({len(rs)} ranks)"
