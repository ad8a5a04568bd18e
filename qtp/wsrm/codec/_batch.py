"""Several SOAP envelopes in one HTTP request: qtp's batching extension, used only between qtp nodes.

WS-RM allows one ``Sequence`` header per envelope, so a standard request carries one message. When both
ends are qtp nodes (the destination answered the ``qtp:Batch`` element of a CreateSequence with its own,
see docs/interop.md), the source may post up to the agreed number of envelopes at once, each a complete,
standard WS-RM message, framed as::

    QTP-BATCH/1\n
    <length in bytes, decimal>\n<envelope>      (repeated)

with the media type ``application/vnd.qtp.soap-batch``. The destination answers with one standard
envelope (the acknowledgements). Nothing in an envelope changes, so each is decoded and validated as if
it had come alone; the framing is checked strictly (digits only, lengths that add up to the body exactly).
"""

from __future__ import annotations

from qtp.wsrm.codec._envelope import InvalidMessage

BATCH_CONTENT_TYPE = "application/vnd.qtp.soap-batch"
_MAGIC = b"QTP-BATCH/1\n"
_MAX_LENGTH_DIGITS = 9


def encode_batch(envelopes: list[bytes]) -> bytes:
    """The request body carrying ``envelopes`` (each one encoded SOAP message), in order."""
    out = [_MAGIC]
    for data in envelopes:
        out.append(b"%d\n" % len(data))
        out.append(data)
    return b"".join(out)


def decode_batch(data: bytes, max_parts: int) -> list[bytes]:
    """The envelopes of a batch body; ``InvalidMessage`` (Sender) when the framing is broken or the batch
    holds more than ``max_parts`` envelopes."""
    if not data.startswith(_MAGIC):
        raise _broken("it does not start with QTP-BATCH/1")
    parts: list[bytes] = []
    at = len(_MAGIC)
    while at < len(data):
        if len(parts) >= max_parts:
            raise _broken(f"it holds more than {max_parts} envelopes")
        end = data.find(b"\n", at, at + _MAX_LENGTH_DIGITS + 1)
        digits = data[at:end]
        if end < 0 or not digits.isdigit():
            raise _broken(f"no length at byte {at}")
        at, size = end + 1, int(digits)
        if size == 0 or at + size > len(data):
            raise _broken(f"a length of {size} at byte {at} runs past the end of the body")
        parts.append(data[at:at + size])
        at += size
    if not parts:
        raise _broken("it holds no envelope")
    return parts


def _broken(why: str) -> InvalidMessage:
    return InvalidMessage("Sender", f"unreadable qtp batch: {why}")
