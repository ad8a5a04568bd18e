"""Errors of the protocol core.

``ProtocolError`` is local misuse or an impossible event: an event the transition table does not allow in
the sequence's state. It is not a wire fault (a peer's misbehaviour is answered with a ``SendFault`` action
instead), and retrying cannot help: the sequence has moved to its terminal ``FAILED`` state.
"""

from __future__ import annotations

from qtp.errors import QtpError


class ProtocolError(QtpError):
    """An event was not allowed in the state of a WS-RM state machine; the machine is now FAILED."""

    retryable = False

    def __init__(self, machine: str, state: str, event: str, why: str):
        super().__init__(f"{machine} in state {state}: {event} is not allowed ({why})")
        self.machine = machine
        self.state = state
        self.event = event
