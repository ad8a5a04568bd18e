"""Sockets and bodies against a node's HTTP server (issue 28): no connection can stall it, no body can blow up
its memory."""

from __future__ import annotations

import time

import pytest

def _bomb() -> bytes:
    """A SOAP 1.2 envelope just under 4 MiB whose payload is empty elements: a million of them."""
    head = b"<s:Envelope xmlns:s='http://www.w3.org/2003/05/soap-envelope'><s:Body><x>"
    tail = b"</x></s:Body></s:Envelope>"
    return head + b"<a/>" * ((4 * 1024 * 1024 - 4096 - len(head) - len(tail)) // 4) + tail


# ---------------------------------------------------------------------------------------------- parsing

def test_decode_refuses_more_elements_than_the_limit_while_parsing():
    """The codec's element limit: a body of a million empty elements is refused (before: parsed, 122 MB of
    tree per body), and quickly, without building its tree; a document whose bytes only look crowded (a
    CDATA section full of '<') is counted, found within the limit and parsed."""
    from qtp.wsrm.codec import InvalidMessage, decode

    began = time.monotonic()
    with pytest.raises(InvalidMessage, match="more than 100000 elements"):
        decode(_bomb(), max_elements=100_000)
    assert time.monotonic() - began < 5
    head = b"<s:Envelope xmlns:s='http://www.w3.org/2003/05/soap-envelope'><s:Body><x xmlns='urn:t'>"
    crowded = head + b"<![CDATA[" + b"<" * 5000 + b"]]></x></s:Body></s:Envelope>"
    assert decode(crowded, max_elements=1000).payload.count(b"&lt;") == 5000
    with pytest.raises(InvalidMessage, match="more than 10 elements"):
        decode(head + b"<![CDATA[<<]]>" + b"<y/>" * 11 + b"</x></s:Body></s:Envelope>", max_elements=10)
