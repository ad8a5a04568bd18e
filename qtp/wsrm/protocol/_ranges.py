"""Acknowledgement ranges: sorted, disjoint, merged ``(lower, upper)`` pairs, as plain tuples.

A sequence's received or acknowledged numbers are kept in this form so that a state that has seen a
million messages still fits in a database row, and so that the SequenceAcknowledgement on the wire is the
value itself (WS-RM wants the ranges merged: 1-3,5 rather than 1,2,3,5).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable

from qtp.wsrm.protocol._messages import AckRanges

_TOP = 1 << 63  # above every message number: (n, _TOP) sorts after every range that starts at n


def add(ranges: AckRanges, number: int) -> AckRanges:
    """``ranges`` with ``number`` included, merged with its neighbours: a binary search and one copy, so a
    sequence with thousands of gaps costs no sort per message."""
    i = bisect.bisect_right(ranges, (number, _TOP))  # ranges[:i] start at or below number
    if i and ranges[i - 1][1] >= number:
        return ranges  # already in
    joins_left = i > 0 and ranges[i - 1][1] == number - 1
    joins_right = i < len(ranges) and ranges[i][0] == number + 1
    if joins_left and joins_right:
        return (*ranges[:i - 1], (ranges[i - 1][0], ranges[i][1]), *ranges[i + 1:])
    if joins_left:
        return (*ranges[:i - 1], (ranges[i - 1][0], number), *ranges[i:])
    if joins_right:
        return (*ranges[:i], (number, ranges[i][1]), *ranges[i + 1:])
    return (*ranges[:i], (number, number), *ranges[i:])


def union(ranges: AckRanges, other: Iterable[tuple[int, int]]) -> AckRanges:
    """Both sets of numbers; ``ranges`` is sorted already, so only ``other`` is sorted (then merged)."""
    merged: list[list[int]] = []
    for lower, upper in heapq.merge(ranges, sorted(other)):
        if merged and lower <= merged[-1][1] + 1:
            if upper > merged[-1][1]:
                merged[-1][1] = upper
        else:
            merged.append([lower, upper])
    return tuple((lower, upper) for lower, upper in merged)


def difference(ranges: AckRanges, other: AckRanges) -> AckRanges:
    """Numbers in ``ranges`` and not in ``other``, in one pass over both."""
    result: list[tuple[int, int]] = []
    j = 0
    for lower, upper in ranges:
        while j < len(other) and other[j][1] < lower:
            j += 1
        start, k = lower, j
        while k < len(other) and other[k][0] <= upper:
            o_lower, o_upper = other[k]
            if o_lower > start:
                result.append((start, o_lower - 1))
            start = max(start, o_upper + 1)
            if start > upper:
                break
            k += 1
        if start <= upper:
            result.append((start, upper))
    return tuple(result)


def contains(ranges: AckRanges, number: int) -> bool:
    i = bisect.bisect_right(ranges, (number, _TOP))
    return i > 0 and ranges[i - 1][1] >= number


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
