"""Acknowledgement ranges: sorted, disjoint, merged ``(lower, upper)`` pairs, as plain tuples.

A sequence's received or acknowledged numbers are kept in this form so that a state that has seen a
million messages still fits in a database row, and so that the SequenceAcknowledgement on the wire is the
value itself (WS-RM wants the ranges merged: 1-3,5 rather than 1,2,3,5).
"""

from __future__ import annotations

from collections.abc import Iterable

from qtp.wsrm.protocol._messages import AckRanges


def add(ranges: AckRanges, number: int) -> AckRanges:
    """``ranges`` with ``number`` included, merged with its neighbours."""
    return union(ranges, ((number, number),))


def union(ranges: AckRanges, other: Iterable[tuple[int, int]]) -> AckRanges:
    merged: list[list[int]] = []
    for lower, upper in sorted([*ranges, *other]):
        if merged and lower <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], upper)
        else:
            merged.append([lower, upper])
    return tuple((lower, upper) for lower, upper in merged)


def difference(ranges: AckRanges, other: AckRanges) -> AckRanges:
    """Numbers in ``ranges`` and not in ``other``."""
    result: list[tuple[int, int]] = []
    for lower, upper in ranges:
        start = lower
        for o_lower, o_upper in other:
            if o_upper < start or o_lower > upper:
                continue
            if o_lower > start:
                result.append((start, o_lower - 1))
            start = max(start, o_upper + 1)
            if start > upper:
                break
        if start <= upper:
            result.append((start, upper))
    return tuple(result)


def contains(ranges: AckRanges, number: int) -> bool:
    return any(lower <= number <= upper for lower, upper in ranges)


def count(ranges: AckRanges) -> int:
    return sum(upper - lower + 1 for lower, upper in ranges)


def highest(ranges: AckRanges) -> int:
    """The largest number in ``ranges``, 0 when empty."""
    return ranges[-1][1] if ranges else 0


def contiguous_from_one(ranges: AckRanges) -> int:
    """The largest n such that 1..n are all in ``ranges`` (0 when 1 is missing)."""
    return ranges[0][1] if ranges and ranges[0][0] == 1 else 0


def numbers(ranges: AckRanges) -> list[int]:
    return [n for lower, upper in ranges for n in range(lower, upper + 1)]


def from_numbers(values: Iterable[int]) -> AckRanges:
    return union((), ((n, n) for n in values))
