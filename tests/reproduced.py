"""Comparing a number recomputed here with the one committed from another machine: equal up to a tolerance stated
from the computation, never bit for bit (another CPU's SIMD width reorders float sums, and its BLAS kernels differ)."""

from __future__ import annotations

import math


def mismatches(ours, committed, rel: float, abs_: float = 0.0, path: str = "") -> list[str]:
    """Where ``ours`` and ``committed`` (JSON-like: dicts, lists, numbers, strings, booleans, None) differ: floats by
    more than ``rel`` relative or ``abs_`` absolute (the larger), anything else at all (keys, lengths, integers,
    booleans, strings). Returns one line per difference, with its path and both values."""
    if isinstance(committed, dict) and isinstance(ours, dict):
        out = [f"{path}: keys {sorted(set(ours) ^ set(committed))} in one only"] if set(ours) != set(committed) else []
        for key in sorted(set(ours) & set(committed), key=str):
            out += mismatches(ours[key], committed[key], rel, abs_, f"{path}/{key}")
        return out
    if isinstance(committed, list) and isinstance(ours, list):
        if len(ours) != len(committed):
            return [f"{path}: {len(ours)} items against {len(committed)}"]
        return [line for i, (a, b) in enumerate(zip(ours, committed, strict=True))
                for line in mismatches(a, b, rel, abs_, f"{path}[{i}]")]
    floats = isinstance(ours, float) or isinstance(committed, float)
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (ours, committed))
    same = (math.isclose(ours, committed, rel_tol=rel, abs_tol=abs_) if floats and numbers
            else ours == committed and type(ours) is type(committed))
    return [] if same else [f"{path}: {ours!r} != {committed!r}"]


def assert_reproduced(ours, committed, rel: float, abs_: float = 0.0) -> None:
    """:func:`mismatches` is empty; the assertion lists the first differences."""
    found = mismatches(ours, committed, rel, abs_)
    assert not found, f"{len(found)} differences beyond rel {rel:g} / abs {abs_:g}:\n" + "\n".join(found[:20])
