"""Coupled messaging: a transaction that depends on what its messages do at their recipients.

``Coupled(node)`` adds it to a node (both roles). At the sender::

    coupled = qtp.coupled.Coupled(node)
    with node.manager.transaction() as tx:
        tx.connection("app").execute(...)                       # the account here
        coupled.send(tx, "bank_b", b"<open .../>", action="urn:bank:open",
                     condition=qtp.coupled.processed(within=5), compensation=b"<close .../>")
    # committed only if bank_b processed it within 5 s; else rolled back and bank_b undoes it

At a recipient::

    @coupled.handler("urn:bank:open", coupling="shared")        # or "compensatable" / "queued"
    def open_account(tx, message): ...

    @coupled.compensator("urn:bank:open")
    def close_account(tx, message): ...

See docs/coupled.md (the model, the couplings, the failure windows, what of Dependency-Spheres and the
Hermes Transaction Service is built).
"""

from qtp.coupled._conditions import Condition, delivered, processed
from qtp.coupled._coupled import Coupled, CoupledMessage
from qtp.coupled._wire import ACTION, NS

__all__ = ["ACTION", "NS", "Condition", "Coupled", "CoupledMessage", "delivered", "processed"]
