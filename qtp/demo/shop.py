"""The shop's server node for ``make demo``: ``qtp serve --app qtp.demo.shop:node`` (QTP_DEMO_CONFIG names
its qtp.toml). Each order is applied in a transaction with its dequeue, and answered with a reply that
travels back reliably to the client node."""

from __future__ import annotations

import os
import re

from sqlalchemy import text

import qtp

node = qtp.Node.from_config(os.environ["QTP_DEMO_CONFIG"])


@node.handler("urn:shop:place")
def place(tx, message):
    order = int(re.search(rb"<id>(\d+)</id>", message.payload).group(1))
    tx.connection("app").execute(text("INSERT INTO applied_orders (order_id, sequence, number) VALUES (:o, :s, :n)"),
                                 {"o": order, "s": message.identifier, "n": message.number})
    return f"<placed xmlns='urn:shop'><id>{order}</id></placed>".encode()
