"""The states of coupled messaging as data: one table for the sender's sphere-log rows, one for the
recipient's coupling rows, and the order of the recipient's reports. Nothing else in ``qtp.coupled`` moves a
row: every change is ``next_state(TABLE, state, event)`` followed by a compare-and-set on the row
(``_log``), and a compare-and-set that matches nothing is handled on purpose by its caller.

Why the recipient needs more states than "received / prepared / done" (issue 27): a shared recipient's
subordinate transaction passes through states where different parties may end it, and the rule that keeps
exactly-once is written into the table:

- *unvoted* work (``preparing``, and ``ordered`` with a leftover subordinate) belongs to the recipient alone:
  nobody counts on it, so it may be rolled back and tried again;
- *voted* work (``prepared`` and after) belongs to the sender's decision: it is committed or rolled back
  only after the decision is recorded in the row (``committing`` / ``rolling-back``), so a subordinate
  that the database no longer knows in ``committing`` was committed by an earlier attempt of this step:
  nothing else can end it once the row left ``preparing``.

The compare-and-set runs under the row's lock in the same local transaction as the effect it guards
(rolling back unvoted work, recording the vote), so a worker acting on an old read of the row finds the
state moved and does nothing.

``python -m qtp.coupled._states`` prints the Mermaid diagrams that docs/coupled.md shows (a test checks
that the document holds exactly these).
"""

from __future__ import annotations

from qtp.errors import ProtocolError

# ------------------------------------------------------------------ the sender's sphere log (state column)

ACTIVE, COMMITTED, ABORTED = "active", "committed", "aborted"

SENDER: dict[tuple[str, str], str] = {
    (ACTIVE, "commit"): COMMITTED,    # Phase 0 met, inside the sender's own transaction (with the Commits)
    (ACTIVE, "abort"): ABORTED,       # the sender rolled back, or its sweep presumed it aborted
    (ABORTED, "retry"): ABORTED,      # an operator sends the Abort again
    (COMMITTED, "status"): COMMITTED,  # a recipient asked: the decision is sent again
    (ABORTED, "status"): ABORTED,
}

# ------------------------------------------------------------------ what a recipient reports (Notify)

# How far each report goes; a later report never moves the sender's row back.
REPORT_RANK = {"sent": 0, "delivered": 1, "processed": 2, "prepared": 2, "failed": 3, "committed": 4,
               "cancelled": 4, "rolled-back": 4, "compensated": 4, "compensation-failed": 4}


def goes_further(report: str, known: str) -> bool:
    """Whether a recipient's ``report`` replaces the ``known`` one: never backwards; at the same rank only
    another state (an operator's retry turns "compensation-failed" into "compensated")."""
    return report != known and REPORT_RANK.get(report, 0) >= REPORT_RANK.get(known, 0)


# A recipient that reported one of these has nothing left to undo: the compensation log's entry is closed.
SETTLED = frozenset({"committed", "cancelled", "rolled-back", "compensated", "failed"})

# ------------------------------------------------------------------ the recipient's coupling rows

RECEIVED = "received"          # stored, undecided, not processed
PREPARING = "preparing"        # shared: an attempt holds a subordinate transaction (gtrid recorded), no vote
PREPARED = "prepared"          # shared: voted; the subordinate waits for the sender's decision
PROCESSED = "processed"        # compensatable / queued: committed on its own, the sender undecided
ORDERED = "ordered"            # the sender committed before this recipient processed it: process, commit
COMMITTING = "committing"      # shared: Commit recorded, the subordinate is being committed
ROLLING_BACK = "rolling-back"  # shared: Abort recorded, the subordinate is being rolled back
COMPENSATING = "compensating"  # processed, then Abort: the compensator is due
FINAL = ("committed", "cancelled", "rolled-back", "compensated", "failed", "compensation-failed")

# (state, event) -> next state. ``None`` as a state: no row (the original never arrived, or was refused
# before it could be stored). An event missing here is refused (ProtocolError names state and event).
RECIPIENT: dict[tuple[str | None, str], str] = {
    (None, "arrive"): RECEIVED,
    (None, "commit"): "failed",              # never arrived: answered, so the sender's log closes
    (None, "abort"): "cancelled",            # never arrived: a tombstone; a late original is not processed

    (RECEIVED, "attempt"): PREPARING,
    (RECEIVED, "process"): PROCESSED,
    (RECEIVED, "refuse"): "failed",
    (RECEIVED, "commit"): ORDERED,
    (RECEIVED, "abort"): "cancelled",

    (PREPARING, "vote"): PREPARED,
    (PREPARING, "undo"): RECEIVED,           # unvoted work rolled back; tried again
    (PREPARING, "refuse"): "failed",         # unvoted work rolled back; the handler refused for good
    (PREPARING, "commit"): ORDERED,          # the attempt's vote finds the row moved and undoes its work
    (PREPARING, "abort"): ROLLING_BACK,

    (ORDERED, "process"): "committed",
    (ORDERED, "refuse"): "failed",
    (ORDERED, "commit"): ORDERED,

    (PREPARED, "commit"): COMMITTING,
    (PREPARED, "abort"): ROLLING_BACK,
    (COMMITTING, "resolved"): "committed",
    (COMMITTING, "commit"): COMMITTING,
    (ROLLING_BACK, "resolved"): "rolled-back",
    (ROLLING_BACK, "abort"): ROLLING_BACK,

    (PROCESSED, "commit"): "committed",
    (PROCESSED, "abort"): COMPENSATING,
    (COMPENSATING, "compensate"): "compensated",
    (COMPENSATING, "refuse"): "compensation-failed",
    (COMPENSATING, "abort"): COMPENSATING,
    ("compensation-failed", "abort"): COMPENSATING,  # sent again by an operator: try again

    # decisions that arrive again (the sender's Status answer, an operator's retry): answered again
    ("committed", "commit"): "committed",
    ("failed", "commit"): "failed",
    ("failed", "abort"): "failed",
    ("cancelled", "abort"): "cancelled",
    ("rolled-back", "abort"): "rolled-back",
    ("compensated", "abort"): "compensated",
}

# The states in which the coupling worker has something to do (``received`` only before its deadline).
WORK = frozenset({RECEIVED, PREPARING, ORDERED, COMMITTING, ROLLING_BACK, COMPENSATING})
# What a recipient reports when its row reaches a state (None: nothing to report).
REPORT = {PREPARED: "prepared", PROCESSED: "processed", "committed": "committed", "cancelled": "cancelled",
          "rolled-back": "rolled-back", "compensated": "compensated", "failed": "failed",
          "compensation-failed": "compensation-failed"}


def next_state(table: dict[tuple[str | None, str], str], state: str | None, event: str) -> str:
    """The state ``event`` moves a row in ``state`` to; ProtocolError when the table has no such move."""
    try:
        return table[(state, event)]
    except KeyError:
        raise ProtocolError("a coupled-messaging row", str(state), event, "not in its transition table") from None


def allowed(table: dict[tuple[str | None, str], str], state: str | None, event: str) -> bool:
    return (state, event) in table


def mermaid(table: dict[tuple[str | None, str], str], title: str) -> str:
    """A Mermaid state diagram of ``table`` (self-loops left out: they only answer a message again)."""
    lines = ["```mermaid", "stateDiagram-v2", f"    %% {title}, drawn from qtp.coupled._states"]
    edges: dict[tuple[str, str], list[str]] = {}
    for (state, event), target in table.items():
        if state == target:
            continue
        edges.setdefault(("[*]" if state is None else state, target), []).append(event)
    for (state, target), events in sorted(edges.items()):
        lines.append(f"    {_node(state)} --> {_node(target)}: {', '.join(sorted(events))}")
    lines.append("```")
    return "\n".join(lines)


def _node(state: str) -> str:
    return state if state == "[*]" else state.replace("-", "_")


def diagrams() -> str:
    return (mermaid(SENDER, "the sender's sphere-log row (qtp_coupled_out.state)") + "\n\n"
            + mermaid(RECIPIENT, "the recipient's coupling row (qtp_coupled_in.state)"))


if __name__ == "__main__":
    print(diagrams())
