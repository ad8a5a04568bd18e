"""The XA transaction branch identifier, and its two wire forms (PostgreSQL gid, MySQL xid literal).

An Xid is (format id, global transaction id, branch qualifier), as in X/Open XA. qtp always uses its own
format id, ``FORMAT_ID``; the global id is ``<node id>/<transaction id>`` so that recovery on a node only
touches its own branches; the branch qualifier is the resource's name. Each part is at most 64 bytes.
"""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from dataclasses import dataclass

from qtp.errors import ConfigurationError

FORMAT_ID = 0x51545031  # "QTP1"
MAX_PART = 64
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
MAX_NODE_ID = MAX_PART - 33  # room for "/" and a 32-hex-digit transaction id


def validate_name(kind: str, value: str, limit: int = MAX_PART) -> str:
    """Check a node id or resource name: 1..limit bytes of letters, digits, ``_ . -``."""
    if not isinstance(value, str) or not _NAME.match(value) or len(value.encode()) > limit:
        raise ConfigurationError(
            f"invalid {kind} {value!r}: use 1 to {limit} characters from A-Z a-z 0-9 _ . -"
        )
    return value


@dataclass(frozen=True, slots=True)
class Xid:
    """A branch identifier. Build one with ``Xid.new(node_id, branch)`` or ``Xid.of(gtrid, branch)``."""

    format_id: int
    gtrid: bytes
    bqual: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.format_id, int) or not 0 <= self.format_id < 2**31:
            raise ValueError(f"Xid format id must be a non-negative 32-bit int, got {self.format_id!r}")
        for part, value in (("gtrid", self.gtrid), ("bqual", self.bqual)):
            if not isinstance(value, bytes) or not 0 < len(value) <= MAX_PART:
                raise ValueError(f"Xid {part} must be 1..{MAX_PART} bytes, got {value!r}")

    # ---------------------------------------------------------------- construction

    @staticmethod
    def new_gtrid(node_id: str) -> bytes:
        """A fresh global transaction id for ``node_id``."""
        validate_name("node id", node_id, MAX_NODE_ID)
        return f"{node_id}/{uuid.uuid4().hex}".encode()

    @classmethod
    def of(cls, gtrid: bytes, branch: str) -> "Xid":
        return cls(FORMAT_ID, gtrid, branch.encode())

    # ---------------------------------------------------------------- parts

    @property
    def node_id(self) -> str | None:
        """The node that created this xid, when it is a qtp xid; else None."""
        if self.format_id != FORMAT_ID or b"/" not in self.gtrid:
            return None
        return self.gtrid.split(b"/", 1)[0].decode(errors="replace")

    @property
    def branch(self) -> str:
        return self.bqual.decode(errors="replace")

    def belongs_to(self, node_id: str) -> bool:
        return self.format_id == FORMAT_ID and self.node_id == node_id

    def __str__(self) -> str:
        return f"{self.gtrid.decode(errors='replace')}#{self.branch}"

    # ---------------------------------------------------------------- PostgreSQL gid

    def to_pg_gid(self) -> str:
        """The gid psycopg2 uses for this xid: ``<format id>_<base64 gtrid>_<base64 bqual>``."""
        gtrid = base64.b64encode(self.gtrid).decode()
        bqual = base64.b64encode(self.bqual).decode()
        return f"{self.format_id}_{gtrid}_{bqual}"

    @classmethod
    def from_pg_gid(cls, gid: str) -> "Xid | None":
        """Parse a gid written by ``to_pg_gid`` (or psycopg2); None for any other gid."""
        parts = gid.split("_")
        if len(parts) != 3 or not parts[0].isdigit():
            return None
        try:
            return cls(int(parts[0]), base64.b64decode(parts[1], validate=True),
                       base64.b64decode(parts[2], validate=True))
        except (ValueError, binascii.Error):
            return None

    # ---------------------------------------------------------------- MySQL / MariaDB xid literal

    def to_mysql(self) -> str:
        """The xid as it appears in ``XA START <xid>``: ``X'<hex gtrid>',X'<hex bqual>',<format id>``."""
        return f"X'{self.gtrid.hex()}',X'{self.bqual.hex()}',{self.format_id}"

    @classmethod
    def from_mysql(cls, literal: str) -> "Xid | None":
        """Parse the literal MariaDB's ``XA RECOVER FORMAT='SQL'`` prints; None when it is not one."""
        match = _MYSQL_LITERAL.match(literal.strip())
        if match is None:
            return None
        gtrid, bqual, fid = match.groups()
        try:
            return cls(int(fid), bytes.fromhex(gtrid), bytes.fromhex(bqual or ""))
        except ValueError:
            return None

    @classmethod
    def from_mysql_parts(cls, format_id: int, gtrid_length: int, bqual_length: int, data: bytes) -> "Xid | None":
        """Parse one row of plain ``XA RECOVER`` (MySQL: ``CONVERT XID`` gives ``data`` as hex)."""
        if len(data) != gtrid_length + bqual_length:
            return None
        try:
            return cls(int(format_id), data[:gtrid_length], data[gtrid_length:])
        except ValueError:
            return None


_MYSQL_LITERAL = re.compile(r"^X'([0-9A-Fa-f]*)',X'([0-9A-Fa-f]*)',(\d+)$")
