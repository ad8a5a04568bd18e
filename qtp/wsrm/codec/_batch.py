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

The same framing carries several held messages in the answer to one WS-MakeConnection poll between qtp
nodes. A qtp poller says it takes them with an HTTP ``Accept`` header (``batch_accept``)::

    Accept: application/vnd.qtp.soap-batch; max=256; bytes=4194304, application/soap+xml, text/xml

naming how many envelopes and how many bytes in all it reads at once; a qtp node answers such a poll with a
batch when it holds two or more messages for the poller (``accepted_batch`` reads the header), and with one
standard envelope otherwise. Other stacks ignore the header and answer one message per poll, as WS-MC says;
qtp answers their polls the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtp.wsrm.codec._envelope import InvalidMessage

BATCH_CONTENT_TYPE = "application/vnd.qtp.soap-batch"
_MAGIC = b"QTP-BATCH/1\n"
_MAX_LENGTH_DIGITS = 9
_MOST_PARTS = 10_000  # envelopes in one batch answer, whatever a poller asks for


@dataclass(frozen=True, slots=True)
class BatchRoom:
    """What a poller takes in one batch answer: at most ``most`` envelopes, ``size`` bytes of body in all."""

    most: int
    size: int


def framed_size(parts: list[bytes]) -> int:
    """The length of the batch body that carries ``parts``."""
    return len(_MAGIC) + sum(len(b"%d\n" % len(part)) + len(part) for part in parts)


def batch_accept(most: int, size: int) -> str:
    """The ``Accept`` header of a qtp node's poll: a batch of up to ``most`` envelopes and ``size`` bytes, or
    one standard SOAP envelope."""
    return f"{BATCH_CONTENT_TYPE}; max={most}; bytes={size}, application/soap+xml, text/xml"


def accepted_batch(accept: str | None) -> BatchRoom | None:
    """The batch a poll's ``Accept`` header takes (None: none; one standard envelope). A header that names the
    batch type without sensible ``max`` and ``bytes`` parameters takes none."""
    for media_range in (accept or "").split(","):
        media, *parameters = (part.strip() for part in media_range.split(";"))
        if media.lower() != BATCH_CONTENT_TYPE:
            continue
        named = dict(p.partition("=")[::2] for p in parameters)
        if named.get("q", "1").strip().rstrip("0").rstrip(".") in ("0", ""):  # q=0: not acceptable
            continue
        most, size = named.get("max", ""), named.get("bytes", "")
        if most.isdigit() and size.isdigit() and len(most) <= _MAX_LENGTH_DIGITS and len(size) <= 12 and \
                int(most) >= 2 and int(size) > 0:
            return BatchRoom(min(int(most), _MOST_PARTS), int(size))
    return None


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
