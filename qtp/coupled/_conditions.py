"""Conditions on a conditional message (Dependency-Spheres): what its recipients must have done, and by when.

A condition is evaluated in Phase 0 of the sender's transaction from what each recipient reported. It is
*met* once enough recipients reached the level asked for, *failed* once that can no longer happen (too many
recipients failed) or the deadline passed first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qtp.errors import ConfigurationError

# What each reported state proves about a recipient.
DELIVERED = frozenset({"delivered", "processed", "prepared", "committed"})
PROCESSED = frozenset({"processed", "prepared", "committed"})
FAILED = frozenset({"failed", "cancelled", "rolled-back", "compensated", "compensation-failed"})


@dataclass(frozen=True)
class Condition:
    """``level``: "processed" (the recipient's handler committed, or prepared as a shared participant) or
    "delivered" (the original is stored at the recipient). ``at_least``: how many recipients (None: all);
    ``by``: the channels that must, whatever the others do; ``within``: seconds from the send."""

    level: str = "processed"
    at_least: int | None = None
    by: tuple[str, ...] = ()
    within: float = 30.0

    def __post_init__(self) -> None:
        if self.level not in ("processed", "delivered"):
            raise ConfigurationError(f"a condition's level is 'processed' or 'delivered', not {self.level!r}")
        if self.at_least is not None and (not isinstance(self.at_least, int) or self.at_least < 1):
            raise ConfigurationError(f"at_least must be a positive number of recipients, got {self.at_least!r}")
        if not isinstance(self.within, (int, float)) or not math.isfinite(self.within) or self.within <= 0:
            raise ConfigurationError(f"within must be a positive number of seconds, got {self.within!r}")

    def check(self, channels: list[str]) -> None:
        unknown = sorted(set(self.by) - set(channels))
        if unknown:
            raise ConfigurationError(f"the condition names {', '.join(unknown)}, which this message is not sent to "
                                     f"(recipients: {', '.join(channels)})")
        if self.at_least is not None and self.at_least > len(channels):
            raise ConfigurationError(f"the condition asks for {self.at_least} recipients of {len(channels)}")

    def verdict(self, states: dict[str, str]) -> bool | None:
        """True: met; False: cannot be met any more; None: not yet. ``states``: channel -> last report."""
        good = DELIVERED if self.level == "delivered" else PROCESSED
        ok = {channel for channel, state in states.items() if state in good}
        lost = {channel for channel, state in states.items() if state in FAILED}
        if any(channel in lost for channel in self.by):
            return False
        need = len(states) if self.at_least is None else self.at_least
        if len(states) - len(lost) < need:
            return False
        if all(channel in ok for channel in self.by) and len(ok) >= need:
            return True
        return None

    def describe(self, count: int) -> str:
        who = "every recipient" if self.at_least is None else f"at least {self.at_least} of {count} recipients"
        named = f" including {', '.join(self.by)}" if self.by else ""
        return f"{self.level} by {who}{named} within {self.within:g} s"


def processed(at_least: int | None = None, by: list[str] | tuple[str, ...] = (), within: float = 30.0) -> Condition:
    """The recipients' handlers must have committed (or, shared, prepared) the original in time."""
    return Condition("processed", at_least, tuple(by), within)


def delivered(at_least: int | None = None, by: list[str] | tuple[str, ...] = (), within: float = 30.0) -> Condition:
    """The original must be stored at the recipients in time (the census of HTS: who joined)."""
    return Condition("delivered", at_least, tuple(by), within)
