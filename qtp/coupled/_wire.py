"""The control messages of coupled messaging: qtp's own namespace, ``urn:qtp:coupled:2026-11``.

Each one is the payload of an ordinary reliable message between two qtp nodes (the Action says which:
``ACTION[kind]``), so it arrives exactly once and in order, and survives a crash of either node. The schema
is ``coupled.xsd`` beside this module; the tests validate everything encoded here against it.

Why not WS-AtomicTransaction / WS-BusinessActivity (docs/coupled.md says more): those protocols run their
own request-response exchanges between a coordinator's and a participant's endpoints (Register, Prepare,
Prepared, Commit, Committed, ...) and assume their messages may be lost, so each side retries and keeps
timers. Here every control message already rides a WS-RM sequence stored in the same databases as the
transaction state it changes, so one message per step suffices, and the states differ (a conditional
message is delivered *before* the sender decides, which WS-AT's Register/Prepare ordering has no place for).
"""

from __future__ import annotations

import copy
import math
import re
import secrets
from dataclasses import dataclass

from lxml import etree

from qtp.errors import CoupledWireError

NS = "urn:qtp:coupled:2026-11"
_Q = "{%s}" % NS
KINDS = ("Message", "Commit", "Abort", "Notify", "Status")
ACTION = {kind: f"{NS}:{kind}" for kind in KINDS}
KIND_OF = {action: kind for kind, action in ACTION.items()}
COUPLINGS = ("shared", "compensatable", "queued")
STATES = ("delivered", "processed", "prepared", "failed", "committed", "cancelled", "rolled-back", "compensated",
          "compensation-failed")
_TOKEN = re.compile(r"[0-9a-f]{32}")
_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, huge_tree=False, remove_blank_text=False)


@dataclass(frozen=True)
class Control:
    """One decoded control message; the fields a kind does not carry are None."""

    kind: str
    id: str
    transaction: str | None = None
    coordinator: str | None = None
    action: str | None = None
    deadline: float | None = None
    body: bytes | None = None
    state: str | None = None
    coupling: str | None = None
    reason: str | None = None
    census: bool = False        # Message: report "delivered" too
    token: str = ""             # the coupling's secret (every kind)
    require: str | None = None  # Message: the coupling the sender requires


def _text(parent: etree._Element, name: str, value: str) -> None:
    etree.SubElement(parent, _Q + name).text = value


def _body(parent: etree._Element, payload: bytes) -> None:
    body = etree.SubElement(parent, _Q + "Body")
    body.append(etree.fromstring(payload, _PARSER))


def encode(control: Control) -> bytes:
    """The payload for ``control`` (checked as it is built: ids of 1..255 characters, a known state)."""
    if control.kind not in KINDS:
        raise CoupledWireError(f"unknown coupled message kind {control.kind!r}")
    if not control.id or len(control.id) > 255:
        raise CoupledWireError("a coupled message id has 1 to 255 characters")
    if not _TOKEN.fullmatch(control.token):
        raise CoupledWireError("a coupled message's token is 32 hexadecimal digits (new_token())")
    root = etree.Element(_Q + control.kind, nsmap={"qc": NS})
    _text(root, "Id", control.id)
    _text(root, "Token", control.token)
    if control.kind == "Message":
        _text(root, "Transaction", control.transaction or "")
        _text(root, "Coordinator", control.coordinator or "")
        _text(root, "Action", control.action or "")
        _text(root, "Deadline", repr(float(control.deadline or 0.0)))
        if control.census:
            _text(root, "Census", "true")
        if control.require is not None:
            if control.require not in COUPLINGS:
                raise CoupledWireError(f"unknown coupling {control.require!r}")
            _text(root, "Require", control.require)
        _body(root, control.body or b"")
    elif control.kind in ("Commit", "Abort"):
        if control.coordinator:
            _text(root, "Coordinator", control.coordinator)
        if control.kind == "Abort" and control.body is not None:
            _body(root, control.body)
    elif control.kind == "Notify":
        if control.state not in STATES or control.coupling not in COUPLINGS:
            raise CoupledWireError(f"bad notification {control.state!r}/{control.coupling!r}")
        _text(root, "State", control.state)
        _text(root, "Coupling", control.coupling)
        if control.reason:
            _text(root, "Reason", control.reason[:1024])
    return etree.tostring(root)


def decode(action: str, payload: bytes | None) -> Control:
    """The control message in ``payload`` sent with ``action``; CoupledWireError when it is not one."""
    kind = KIND_OF.get(action)
    if kind is None or payload is None:
        raise CoupledWireError(f"{action!r} is not a coupled control action")
    try:
        root = etree.fromstring(payload, _PARSER)
    except etree.XMLSyntaxError as exc:
        raise CoupledWireError(f"a coupled {kind} is not XML: {exc}") from None
    if root.tag != _Q + kind:
        raise CoupledWireError(f"action {action} carries {root.tag}, expected {_Q + kind}")
    children = {child.tag[len(_Q):]: child for child in root if isinstance(child.tag, str) and
                child.tag.startswith(_Q)}

    def text(name: str, required: bool = True) -> str | None:
        node = children.get(name)
        if node is None:
            if required:
                raise CoupledWireError(f"a coupled {kind} without {name}")
            return None
        value = (node.text or "").strip()
        if required and not value or len(value) > 1024:
            raise CoupledWireError(f"a coupled {kind}'s {name} is empty or too long")
        return value

    def body() -> bytes | None:
        node = children.get("Body")
        if node is None:
            return None
        inner = [c for c in node if isinstance(c.tag, str)]
        if len(inner) != 1:
            raise CoupledWireError(f"a coupled {kind}'s Body holds {len(inner)} elements, not one")
        element = copy.deepcopy(inner[0])  # detached: the envelope's namespace declarations left behind
        etree.cleanup_namespaces(element)
        return etree.tostring(element)

    identifier = text("Id") or ""
    if len(identifier) > 255:
        raise CoupledWireError("a coupled message id over 255 characters")
    token = text("Token") or ""
    if not _TOKEN.fullmatch(token):
        raise CoupledWireError(f"a coupled {kind}'s Token is not 32 hexadecimal digits")
    if kind == "Message":
        try:
            deadline = float(text("Deadline") or "")
        except ValueError:
            raise CoupledWireError("a coupled Message's Deadline is not a number") from None
        if not math.isfinite(deadline):
            raise CoupledWireError("a coupled Message's Deadline is not finite")
        payload_body = body()
        if payload_body is None:
            raise CoupledWireError("a coupled Message without Body")
        census = text("Census", required=False)
        if census not in (None, "true", "false", "1", "0"):
            raise CoupledWireError(f"a coupled Message's Census is not a boolean: {census!r}")
        require = text("Require", required=False)
        if require is not None and require not in COUPLINGS:
            raise CoupledWireError(f"a coupled Message requires an unknown coupling {require!r}")
        return Control(kind, identifier, transaction=text("Transaction"), coordinator=text("Coordinator"),
                       action=text("Action"), deadline=deadline, body=payload_body, census=census in ("true", "1"),
                       token=token, require=require)
    if kind in ("Commit", "Abort"):
        return Control(kind, identifier, coordinator=text("Coordinator", required=False),
                       body=body() if kind == "Abort" else None, token=token)
    if kind == "Notify":
        state, coupling = text("State"), text("Coupling")
        if state not in STATES or coupling not in COUPLINGS:
            raise CoupledWireError(f"a coupled Notify with state {state!r} and coupling {coupling!r}")
        return Control(kind, identifier, state=state, coupling=coupling, reason=text("Reason", required=False),
                       token=token)
    return Control(kind, identifier, token=token)


def new_token() -> str:
    """A fresh coupling secret."""
    return secrets.token_hex(16)
