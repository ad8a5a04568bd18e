"""The tables of coupled messaging, in the stores' databases.

``qtp_coupled_out`` (the sender's *sphere log*, in the store of each coupled channel): one row per original
and recipient, with the transaction's state (active, committed, aborted), what the recipient last reported,
and the compensation given with the original. It is written with the original (pre-commit delivery, a
local transaction of the store), moved to "committed" *inside* the sender's global transaction together with
the Commit messages, and to "aborted" with the Abort messages after a rollback. After an abort, the rows
whose recipient has not reported "cancelled", "rolled-back" or "compensated" are the compensation log's open
entries (``qtp coupled list``).

``qtp_coupled_in`` (the recipient's, in its inbound store): one row per original received, its coupling,
payload, state, the sender's decision once known, and for a shared coupling the subordinate transaction's
gtrid and prepared branches.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

_BLOB = sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
_ID = sa.String(255)

metadata = sa.MetaData()

outbound = sa.Table(
    "qtp_coupled_out", metadata,
    sa.Column("id", _ID, primary_key=True),
    sa.Column("gtrid", sa.String(64), nullable=False),
    sa.Column("channel", _ID, nullable=False),
    sa.Column("action", sa.String(1024), nullable=False),
    sa.Column("compensation", _BLOB),
    sa.Column("state", sa.String(16), nullable=False),       # active, committed, aborted
    sa.Column("recipient", sa.String(24), nullable=False),   # sent, or the recipient's last Notify state
    sa.Column("coupling", sa.String(16)),
    sa.Column("reason", sa.String(1024)),
    sa.Column("token", sa.String(32)),                       # the coupling's secret (every control message)
    sa.Column("deadline", sa.Float(53), nullable=False),
    sa.Column("created_at", sa.Float(53), nullable=False),
    sa.Column("updated_at", sa.Float(53), nullable=False),
    sa.Index("qtp_coupled_out_gtrid", "gtrid"),
    sa.Index("qtp_coupled_out_state", "state", "recipient"),
)

inbound = sa.Table(
    "qtp_coupled_in", metadata,
    sa.Column("id", _ID, primary_key=True),
    sa.Column("coordinator", sa.String(64), nullable=False),
    sa.Column("owner", _ID),                                 # the authenticated peer that sent it (None: anonymous)
    sa.Column("token", sa.String(32)),                       # the coupling's secret, from the original
    sa.Column("gtrid", sa.String(64), nullable=False),       # the sender's transaction
    sa.Column("action", sa.String(1024), nullable=False),
    sa.Column("coupling", sa.String(16), nullable=False),
    sa.Column("payload", _BLOB, nullable=False),
    sa.Column("compensation", _BLOB),
    sa.Column("state", sa.String(24), nullable=False),
    sa.Column("decision", sa.String(8)),                     # written before issue 27 only (see LEGACY)
    sa.Column("sub_gtrid", sa.String(64)),
    sa.Column("branches", sa.String(1024)),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("next_at", sa.Float(53), nullable=False, default=0.0),
    sa.Column("error", sa.String(2048)),
    sa.Column("deadline", sa.Float(53), nullable=False),
    sa.Column("received_at", sa.Float(53), nullable=False),
    sa.Column("updated_at", sa.Float(53), nullable=False),
    sa.Index("qtp_coupled_in_state", "state", "next_at"),
    sa.Index("qtp_coupled_in_owner", "owner", "state"),
)


def create(engine: sa.Engine) -> None:
    """Create the tables, and add the columns a table made by an earlier version lacks."""
    metadata.create_all(engine)
    inspector = sa.inspect(engine)
    for table in metadata.tables.values():
        present = {c["name"] for c in inspector.get_columns(table.name)}
        missing = [c for c in table.columns if c.name not in present]
        if missing:
            with engine.begin() as conn:
                for column in missing:
                    kind = column.type.compile(dialect=engine.dialect)
                    conn.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}"))
    with engine.begin() as conn:  # rows of the version before the states table (state + decision columns)
        for state, where in LEGACY:
            conn.execute(inbound.update().where(*where).values(state=state))


# What a row written before the transition table (issue 27) means in its states: an unvoted attempt left a
# gtrid in "received"; the decision was a column of its own.
LEGACY = [
    ("preparing", [inbound.c.state == "received", inbound.c.sub_gtrid.is_not(None)]),
    ("ordered", [inbound.c.state == "received", inbound.c.decision == "commit"]),
    ("compensating", [inbound.c.state == "processed", inbound.c.decision == "abort"]),
]
