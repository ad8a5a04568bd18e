"""Reading what a peer returns on the HTTP response to our request or poll.

An answer is decoded with ``decode(answer=True)``: a Sequence header that breaks the schema on an empty-body
answer (gSOAP writes MessageNumber 0 there, docs/interop.md D17) is set aside so that the acknowledgements
next to it still count. Each such answer is counted (``qtp_answer_headers_ignored_total``) and logged as a
warning, at most one line a minute (``RefusalWarnings``).
"""

from __future__ import annotations

import logging
from typing import Any

from qtp.wsrm.codec import Envelope, decode
from qtp.wsrm.runtime._refusals import RefusalWarnings

log = logging.getLogger("qtp.wsrm.answers")

_warnings = RefusalWarnings(summary="set aside %s more %s header(s) of answers in the last %.0f s")


def read_answer(data: bytes, peer: str, metrics: Any) -> Envelope:
    """The envelope ``peer`` answered with; raises InvalidMessage as ``decode`` does. ``metrics``: the node's
    ``Metrics`` (its ``ignored_headers`` counter)."""
    envelope = decode(data, answer=True)
    if envelope.ignored:
        metrics.ignored_headers.inc(len(envelope.ignored))
        _warnings.warn(log, "invalid", "%s answered with a header that breaks the schema, set aside (the "
                       "acknowledgements next to it are taken): %s", peer, "; ".join(envelope.ignored))
    return envelope
