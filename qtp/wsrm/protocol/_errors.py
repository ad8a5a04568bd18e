"""Errors of the protocol core.

``ProtocolError`` is local misuse or an impossible event: an event the transition table does not allow in
the sequence's state. It is not a wire fault (a peer's misbehaviour is answered with a ``SendFault`` action
instead), and retrying cannot help: the sequence has moved to its terminal ``FAILED`` state.
"""

from __future__ import annotations

from qtp.errors import ProtocolError

__all__ = ["ProtocolError"]
