"""SOAP 1.1/1.2 envelopes for WS-RM 1.0 (with WS-Addressing 2004/08 or 2005/08) and WS-RM 1.1 (with
WS-MakeConnection 1.1), with lxml.

``encode(envelope) -> bytes`` is strict; ``decode(data) -> Envelope`` is hardened and tolerant and raises
``InvalidMessage`` (a ``qtp.errors.WsrmFault`` carrying the wire fault code) for input it cannot use.
``Validator`` checks emitted envelopes against the official schemas, loaded from local files.
"""

from qtp.wsrm.codec._batch import (
    BATCH_CONTENT_TYPE,
    BatchRoom,
    accepted_batch,
    batch_accept,
    decode_batch,
    encode_batch,
    framed_size,
)
from qtp.wsrm.codec._decode import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_ELEMENTS,
    decode,
    most_elements,
    parse_duration,
)
from qtp.wsrm.codec._encode import CheckedPayload, check_payload, default_action, encode, format_duration
from qtp.wsrm.codec._envelope import Addressing, EncodingError, Envelope, InvalidMessage, MakeConnection, SoapFault
from qtp.wsrm.codec._names import (
    COMBINATIONS,
    MAKE_CONNECTION_ACTION,
    MISSING_SELECTION,
    RM_NS,
    SOAP_NS,
    UNSUPPORTED_SELECTION,
    WSA_NS,
    WSMC_ANONYMOUS,
    WSMC_FAULT_ACTION,
    WSMC_NS,
    SoapVersion,
    WsaVersion,
    action,
    anonymous,
    mc_anonymous,
    mc_id,
    reply_destination,
)
from qtp.wsrm.codec._schemas import SCHEMA_FILES, WSMC_SCHEMA_FILE, Validator

__all__ = [
    "BATCH_CONTENT_TYPE", "COMBINATIONS", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_DEPTH", "DEFAULT_MAX_ELEMENTS",
    "MAKE_CONNECTION_ACTION", "MISSING_SELECTION", "RM_NS", "SCHEMA_FILES", "SOAP_NS", "UNSUPPORTED_SELECTION",
    "WSA_NS", "WSMC_ANONYMOUS", "WSMC_FAULT_ACTION", "WSMC_NS", "WSMC_SCHEMA_FILE",
    "Addressing", "BatchRoom", "CheckedPayload", "EncodingError", "Envelope", "InvalidMessage", "MakeConnection",
    "SoapFault", "SoapVersion", "Validator", "WsaVersion",
    "accepted_batch", "action", "anonymous", "batch_accept", "check_payload", "decode", "decode_batch",
    "default_action", "encode", "encode_batch", "format_duration", "framed_size", "mc_anonymous", "mc_id",
    "most_elements", "parse_duration", "reply_destination",
]
