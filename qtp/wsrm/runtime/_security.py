"""Who is talking: peers, how they prove it, and where this node agrees to send.

A node knows its peers from ``[peers.NAME]`` tables, NAME being the peer's ``[node] id``::

    [peers.shop-1]
    endpoint = "https://shop.example:8443/rm"   # its address: our channels to it, its AcksTo / ReplyTo / Offer
    secret_env = "QTP_SECRET_SHOP"              # or secret = "..." (at least 32 characters)
    fingerprint = "sha256:AB:CD:..."            # optional: its TLS client certificate, pinned
    allow_addresses = ["https://shop.example:8444/rm"]   # optional: more addresses it may name

How a peer proves who it is:

- **An HMAC of the request** (``X-Qtp-Signature``): HMAC-SHA256, with the secret both nodes share, over
  the sending node's id, the receiving node's id (the name the sender gives it in its ``[peers]``), the
  receiver's current start (its *boot*, below), a Unix timestamp in milliseconds, a random nonce, the
  method, the path and the body. It authenticates the body (not just the caller), works over plain HTTP as
  well as TLS and costs one hash per request. A captured request cannot be replayed: a signature is taken
  once (``SeenSignatures`` remembers those taken until their timestamp leaves the ``[limits]
  max_clock_skew`` window, after which the timestamp check refuses them), another node that shares the
  sender's secret refuses it because it names another receiver, and the same node after a restart refuses
  it because it names a former boot. The nonce keeps two honest requests with the same body in the same
  second (polls, acknowledgements) distinct.
  The response is signed the same way, bound to the request's signature, so acknowledgements on a
  response are authenticated too. A bearer token was not chosen: it is a password sent in every request,
  which authenticates nothing of the body it travels with.
- **Mutual TLS**: ``[node] tls_client_ca`` makes the server ask for a client certificate; a certificate
  signed by that CA whose SHA-256 fingerprint is pinned by ``[peers.NAME] fingerprint`` (or, without pins,
  whose subject CN is NAME) identifies the peer.

Every credential configured for a peer is required (``identify``): a peer with a secret signs every request,
a peer with a pinned fingerprint presents that certificate on every request, so a peer with both proves
both, and a stolen secret or a stolen key alone is not enough. A signature and a certificate that name two
different peers prove nothing.

A request that proves nothing is *anonymous*. A node accepts anonymous requests only when ``[node]
allow_anonymous = true``, or by default when it listens on loopback only (a development set-up); what an
anonymous peer may do is still bounded (see docs/security.md).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from qtp.errors import AuthenticationError, ConfigurationError, StaleBoot

HEADER = "X-Qtp-Signature"
WSGI_HEADER = "HTTP_X_QTP_SIGNATURE"
MIN_SECRET = 32
ANONYMOUS = None  # the identity of a request that proved nothing
_FIELD = re.compile(r'(\w+)="([^"]*)"')
_NAME = r"[\x21\x23-\x5b\x5d-\x7e]{1,255}"  # a node id: printable ASCII, no quote or backslash
_WELL_FORMED = {  # what each field of a signature header may be; anything else is refused before any use
    "id": re.compile(_NAME),
    "to": re.compile(_NAME),
    "ts": re.compile(r"[0-9]{1,15}"),  # Unix time in milliseconds
    "nonce": re.compile(r"[A-Za-z0-9_-]{16,64}"),
    "sig": re.compile(r"[A-Za-z0-9+/]{43}="),  # base64 of an HMAC-SHA256
    "boot": re.compile(r"[A-Za-z0-9_-]{0,43}"),  # the receiver's boot as the sender knows it ("": unknown)
}
BOOT_HEADER = "X-Qtp-Boot"  # on every answer: the answering node's boot, which signers put in their requests


@dataclass(frozen=True)
class Peer:
    name: str
    endpoint: str | None = None
    secret: bytes | None = None
    fingerprint: str | None = None
    allow_addresses: tuple[str, ...] = ()

    def may_name(self, address: str) -> bool:
        """Whether this peer may ask us to send to ``address`` (its endpoint or an allowed address)."""
        return any(_same_url(address, allowed) for allowed in (self.endpoint, *self.allow_addresses) if allowed)


@dataclass(frozen=True)
class Security:
    """The node's side: its TLS material, whether it takes anonymous requests, its peers."""

    peers: dict[str, Peer] = field(default_factory=dict)
    allow_anonymous: bool | None = None  # None: only when listening on loopback
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None     # asks for client certificates signed by this CA
    tls_ca: str | None = None            # CA bundle to verify the peers' server certificates (None: system)
    metrics_token: str | None = None     # required as "Authorization: Bearer ..." on /metrics when set
    anonymous_addresses: tuple[str, ...] = ()  # where anonymous peers may ask us to send (loopback by default)

    def peer_for_url(self, url: str) -> Peer | None:
        """The peer whose endpoint (or allowed address) ``url`` is."""
        for peer in self.peers.values():
            if peer.may_name(url):
                return peer
        return None

    def anonymous_allowed(self, listen_host: str | None) -> bool:
        if self.allow_anonymous is not None:
            return self.allow_anonymous
        return listen_host is None or is_loopback(listen_host)

    def require_metrics_token(self, listen_host: str | None) -> None:
        """A node listening beyond loopback serves ``/metrics`` only with a token: the metrics name its peers
        and its polling clients, and anyone who reaches the port would read them."""
        if self.metrics_token is None and listen_host is not None and not is_loopback(listen_host):
            raise ConfigurationError(f"[node] listens on {listen_host}, beyond loopback: set [node] metrics_token "
                                     "(16+ characters; /metrics then needs Authorization: Bearer TOKEN), or "
                                     "listen on 127.0.0.1")

    def anonymous_may_name(self, address: str, listen_host: str | None) -> bool:
        if self.anonymous_addresses:
            return any(_same_url(address, a) or address.startswith(a.rstrip("*")) and a.endswith("*")
                       for a in self.anonymous_addresses)
        key = _url_key(address)
        host = key[1] if key is not None else ""
        return bool(host) and is_loopback(host) and (listen_host is None or is_loopback(listen_host))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _url_key(url: str) -> tuple[str, str, int, str] | None:
    """Scheme, host, port and path of ``url``, what makes two spellings the same address (None: it does not
    parse, e.g. two ports, a port out of range or not in ASCII digits, an unclosed IPv6 literal)."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return parts.scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/")


def _same_url(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are the same address; an address that does not parse is the same as none."""
    key = _url_key(a)
    return key is not None and key == _url_key(b)


# ---------------------------------------------------------------------------------------------- signatures

def _mac(secret: bytes, *parts: bytes) -> str:
    return base64.b64encode(hmac.new(secret, b"\n".join(parts), hashlib.sha256).digest()).decode()


def _request_mac(secret: bytes, fields: dict[str, str], method: str, path: str, body: bytes) -> str:
    return _mac(secret, b"request", fields["id"].encode(), fields["to"].encode(), fields["boot"].encode(),
                fields["ts"].encode(), fields["nonce"].encode(), method.upper().encode(), (path or "/").encode(),
                hashlib.sha256(body).digest())


def sign_request(secret: bytes, sender: str, receiver: str, method: str, path: str, body: bytes,
                 now: float | None = None, boot: str = "") -> str:
    """The ``X-Qtp-Signature`` of one request from node ``sender`` to node ``receiver`` (its peer name),
    whose current boot is ``boot`` (as its last answer said; "" before any answer, which it refuses and
    answers with its boot): sign each attempt anew, since a receiver takes a signature once."""
    fields = {"id": sender, "to": receiver, "boot": boot,
              "ts": str(int((time.time() if now is None else now) * 1000)), "nonce": secrets.token_urlsafe(12)}
    fields["sig"] = _request_mac(secret, fields, method, path, body)
    return ", ".join(f'{key}="{value}"' for key, value in fields.items())


def sign_response(secret: bytes, sender: str, request_signature: str, status: int, body: bytes) -> str:
    mac = _mac(secret, b"response", sender.encode(), request_signature.encode(), str(status).encode(),
               hashlib.sha256(body).digest())
    return f'id="{sender}", sig="{mac}"'


def parse(header: str, required: tuple[str, ...]) -> dict[str, str]:
    """The fields of a signature header, each present once and well formed; AuthenticationError otherwise
    (a header is whatever a client sent: nothing of it is used before this check)."""
    found = _FIELD.findall(header or "")
    fields = dict(found)
    for key in required:
        value = fields.get(key)
        if value is None or not _WELL_FORMED[key].fullmatch(value):
            raise AuthenticationError(f"the signature header's {key} is missing or malformed")
    if len(fields) != len(found):
        raise AuthenticationError("the signature header repeats a field")
    return fields


def answer_boot(headers: Any) -> str | None:
    """The boot an answer's ``X-Qtp-Boot`` header gives (None: none, or not one a node draws)."""
    boot = headers.get(BOOT_HEADER)
    return boot if boot and _WELL_FORMED["boot"].fullmatch(boot) else None


class SeenSignatures:
    """The request signatures this node has taken, so that each is taken once, and the node's boot.

    A signature is remembered until its timestamp leaves the ``max_clock_skew`` window; after that the
    timestamp check refuses it without help. Entries are kept per timestamp second, so a lookup touches one
    set and forgetting drops whole seconds. Memory: 16 bytes of each MAC plus Python's overhead, 82 bytes
    per signed request taken in the window (tracemalloc, 60,000 entries): 5 MB at 1,000 requests/s with the
    default 60 s window (25 MB with 300 s); a peer whose clock runs ahead keeps its entries up to twice the
    window. A check costs about 10 microseconds.

    The memory is lost with the process, so each start of the node draws a random ``boot`` (128 bits), gives
    it on every answer (``X-Qtp-Boot``) and takes only requests whose MAC names it: whatever an earlier run
    took names an earlier boot and is refused, whatever its timestamp (refusing signatures dated before the
    start was not enough: a peer whose clock runs ahead dates its requests up to ``max_clock_skew`` later,
    and those were taken again after a restart). A signer learns the boot from the answers it gets; after
    either side starts, its first request names no boot or a former one, is refused with a 401 that gives
    the current one, and is signed again and sent once more at once: one extra round trip per start.

    The boot in an answer is not signed (a 401 cannot be: the sender is not known yet), so someone on the
    path can change it; the sender's requests then name a wrong boot and are refused, which is a denial of
    service that the same attacker can have by dropping the packets. It cannot make a replay taken: the
    receiver checks the boot it drew, not one that travelled.
    """

    def __init__(self, window: float):
        self.window = window
        self.boot = secrets.token_urlsafe(16)
        # a replica of a node whose replicas share the work also takes the boots of the other live replicas
        # (a peer signs with the boot of whichever replica answered it last): qtp.wsrm.runtime._shared
        self.others: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._by_second: dict[int, set[bytes]] = {}
        self._horizon = 0  # seconds below it are forgotten

    def first_time(self, ts: int, mac: str, now: float) -> bool:
        """Whether the signature ``mac`` of timestamp ``ts`` (milliseconds) is new (it is then remembered)."""
        key = base64.b64decode(mac)[:16]
        with self._lock:
            horizon = int(now - self.window)
            if horizon > self._horizon:
                for second in [s for s in self._by_second if s < horizon]:
                    del self._by_second[second]
                self._horizon = horizon
            seen = self._by_second.setdefault(ts // 1000, set())
            if key in seen:
                return False
            seen.add(key)
            return True


def signed_by(security: Security, header: str, method: str, path: str, body: bytes, receiver: str,
              window: float) -> Peer:
    """The peer whose signature this request carries, for node ``receiver``, within the clock skew ``window``
    (AuthenticationError otherwise), without the boot and once-only checks of ``verify_request``: what a
    replica checks before it passes a request on to the replica that takes it (and checks it all)."""
    return _signed_by(security, header, method, path, body, receiver, window, time.time())[0]


def _signed_by(security: Security, header: str, method: str, path: str, body: bytes, receiver: str,
               window: float, now: float) -> tuple[Peer, dict[str, str]]:
    fields = parse(header, ("id", "to", "boot", "ts", "nonce", "sig"))
    sender = fields["id"]
    peer = security.peers.get(sender)
    if peer is None or peer.secret is None:
        raise AuthenticationError(f"unknown peer {sender!r}")
    if fields["to"] != receiver:
        raise AuthenticationError(f"peer {sender}: the request is signed for node {fields['to']!r}, not this one")
    if abs(now - int(fields["ts"]) / 1000) > window:
        raise AuthenticationError(f"peer {sender}: timestamp outside the allowed clock skew ({window:g} s)")
    if not hmac.compare_digest(_request_mac(peer.secret, fields, method, path, body), fields["sig"]):
        raise AuthenticationError(f"peer {sender}: signature does not match")
    return peer, fields


def verify_request(security: Security, header: str, method: str, path: str, body: bytes, receiver: str,
                   seen: SeenSignatures, now: float | None = None) -> Peer:
    """The peer that signed this request for node ``receiver``; AuthenticationError when the signature does
    not hold, is for another node, is outside the clock-skew window, or was taken before; StaleBoot when it
    names another start of this node."""
    now = time.time() if now is None else now
    peer, fields = _signed_by(security, header, method, path, body, receiver, seen.window, now)
    sender, ts = peer.name, int(fields["ts"])
    if fields["boot"] != seen.boot and fields["boot"] not in seen.others:
        raise StaleBoot(f"peer {sender}: the request names another start of this node (boot "
                        f"{fields['boot'] or 'none'!r}; now {seen.boot!r}): signed before it knew this one, "
                        "or replayed")
    if not seen.first_time(ts, fields["sig"], now):
        raise AuthenticationError(f"peer {sender}: this signature was taken before (a replayed request)")
    return peer


def verify_response(peer: Peer, header: str, request_signature: str, status: int, body: bytes) -> None:
    """Check that ``peer`` signed its answer to our request; AuthenticationError otherwise."""
    try:
        fields = parse(header, ("id", "sig"))
    except AuthenticationError as exc:
        raise AuthenticationError(f"the answer of {peer.name} is not signed by it ({exc})") from None
    expected = _mac(peer.secret or b"", b"response", fields["id"].encode(), request_signature.encode(),
                    str(status).encode(), hashlib.sha256(body).digest())
    if peer.secret is None or fields["id"] != peer.name or not hmac.compare_digest(expected, fields["sig"]):
        raise AuthenticationError(f"the answer of {peer.name} is not signed by it")


def identify(signed: Peer | None, certified: Peer | None) -> Peer | None:
    """The peer a request proves, from the peer its signature names and the peer its client certificate
    names (None: anonymous). Every credential configured for the peer is required, so a peer with a
    secret and a fingerprint proves both; two proofs that name different peers prove nothing."""
    if signed is not None and certified is not None and signed.name != certified.name:
        raise AuthenticationError(f"signed as {signed.name} but the client certificate is {certified.name}'s")
    peer = signed or certified
    if peer is None:
        return None
    if peer.secret is not None and signed is None:
        raise AuthenticationError(f"peer {peer.name} has a secret: its requests must be signed as well")
    if peer.fingerprint is not None and certified is None:
        raise AuthenticationError(f"peer {peer.name} has a pinned certificate: its requests must present it as well")
    return peer


def certificate_peer(security: Security, environ: dict[str, Any]) -> Peer | None:
    """The peer a verified TLS client certificate names (pinned fingerprint, else subject CN)."""
    if environ.get("SSL_CLIENT_VERIFY") != "SUCCESS" or not environ.get("SSL_CLIENT_CERT"):
        return None
    der = ssl.PEM_cert_to_DER_cert(environ["SSL_CLIENT_CERT"])
    fingerprint = fingerprint_of(der)
    pinned = [p for p in security.peers.values() if p.fingerprint]
    for peer in pinned:
        if peer.fingerprint == fingerprint:
            return peer
    if pinned:
        return None
    common_name = environ.get("SSL_CLIENT_S_DN_CN")
    return security.peers.get(common_name or "")


def fingerprint_of(der: bytes) -> str:
    digest = hashlib.sha256(der).hexdigest().upper()
    return "sha256:" + ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


# ---------------------------------------------------------------------------------------------- settings

_PEER_KEYS = {"endpoint", "secret", "secret_env", "fingerprint", "allow_addresses"}
_NODE_KEYS = {"allow_anonymous", "tls_cert", "tls_key", "tls_client_ca", "tls_ca", "metrics_token",
              "anonymous_addresses"}


def security_settings(node: dict[str, Any], peers: dict[str, Any], check_url: Any) -> Security:
    """``[peers.NAME]`` tables and the security keys of ``[node]``, checked."""
    parsed: dict[str, Peer] = {}
    for name, table in (peers or {}).items():
        where = f"[peers.{name}]"
        if not isinstance(table, dict) or set(table) - _PEER_KEYS:
            raise ConfigurationError(f"{where} takes {', '.join(sorted(_PEER_KEYS))}; got {sorted(table)}")
        secret = table.get("secret")
        if "secret_env" in table:
            if secret is not None:
                raise ConfigurationError(f"{where}: give secret or secret_env, not both")
            secret = os.environ.get(str(table["secret_env"]))
            if secret is None:
                raise ConfigurationError(f"{where}: the environment variable {table['secret_env']} is not set")
        if secret is not None and (not isinstance(secret, str) or len(secret) < MIN_SECRET):
            raise ConfigurationError(f"{where}: the secret must be a string of at least {MIN_SECRET} characters "
                                     "(for example `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        fingerprint = table.get("fingerprint")
        if fingerprint is not None:
            fingerprint = str(fingerprint).upper().replace("SHA256:", "sha256:")
            if not re.fullmatch(r"sha256:([0-9A-F]{2}:){31}[0-9A-F]{2}", fingerprint):
                raise ConfigurationError(f"{where}: fingerprint must look like sha256:AB:CD:... (32 bytes), as "
                                         "`openssl x509 -noout -fingerprint -sha256` prints it")
        if secret is None and fingerprint is None and not node.get("tls_client_ca"):
            raise ConfigurationError(f"{where}: say how the peer authenticates: secret (or secret_env), or a TLS "
                                     "client certificate (fingerprint, or [node] tls_client_ca)")
        endpoint = table.get("endpoint")
        if endpoint is not None:
            check_url(f"{where} endpoint", endpoint)
        allow = table.get("allow_addresses", [])
        if not isinstance(allow, list):
            raise ConfigurationError(f"{where} allow_addresses must be a list of URLs")
        for url in allow:
            check_url(f"{where} allow_addresses", url)
        parsed[name] = Peer(name=name, endpoint=endpoint, secret=secret.encode() if secret else None,
                            fingerprint=fingerprint, allow_addresses=tuple(allow))
    allow_anonymous = node.get("allow_anonymous")
    if allow_anonymous is not None and not isinstance(allow_anonymous, bool):
        raise ConfigurationError("[node] allow_anonymous must be true or false")
    files = {}
    for key in ("tls_cert", "tls_key", "tls_client_ca", "tls_ca"):
        value = node.get(key)
        if value is not None and not os.path.isfile(str(value)):
            raise ConfigurationError(f"[node] {key}: file {value!r} not found")
        files[key] = None if value is None else str(value)
    if bool(files["tls_cert"]) != bool(files["tls_key"]):
        raise ConfigurationError("[node] tls_cert and tls_key go together (the server's certificate and key)")
    addresses = node.get("anonymous_addresses", [])
    if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
        raise ConfigurationError("[node] anonymous_addresses must be a list of URLs (a trailing * matches a prefix)")
    token = node.get("metrics_token")
    if token is not None and (not isinstance(token, str) or len(token) < 16):
        raise ConfigurationError("[node] metrics_token must be a string of at least 16 characters")
    return Security(peers=parsed, allow_anonymous=allow_anonymous, metrics_token=token,
                    anonymous_addresses=tuple(addresses), **files)


def node_keys() -> set[str]:
    return set(_NODE_KEYS)
