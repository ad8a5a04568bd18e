"""What the coupled-messaging tests share: ``Bank`` (a node that opens accounts through a coupled handler and
closes them with its compensator) and ``make_banks``, behind the ``banks`` fixture of conftest.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import sqlalchemy as sa
from lxml import etree

import qtp
from qtp.coupled import Coupled
from qtp.testing.coupled_nodes import accounts_schema, node_ids, write_configs

OPEN = "urn:bank:open"


class Bank:
    """One node with its accounts table and a coupled handler that opens accounts (and a compensator that
    closes them). ``refuse``: account ids its handler raises for."""

    def __init__(self, config: Path, url: str, coupling: str = "shared"):
        self.config, self.url, self.coupling = config, url, coupling
        self.refuse: set[str] = set()
        self.node: qtp.Node | None = None
        self.coupled: Coupled | None = None

    def start(self) -> "Bank":
        self.node = qtp.Node.from_config(self.config)
        self.id = self.node.manager.node_id
        self.coupled = Coupled(self.node, sweep_interval=0.5)

        @self.coupled.handler(OPEN, coupling=self.coupling)
        def open_account(tx, message):
            account = etree.fromstring(message.payload).get("id")
            if account in self.refuse:
                raise ValueError(f"account {account} refused by the test")
            tx.connection("app").execute(sa.text("INSERT INTO accounts (id, status, opened_by) VALUES (:i, 'open', :b)"),
                                         {"i": account, "b": message.transaction})

        @self.coupled.compensator(OPEN)
        def close_account(tx, message):
            account = etree.fromstring(message.payload).get("id")
            tx.connection("app").execute(sa.text("UPDATE accounts SET status = 'closed' WHERE id = :i"),
                                         {"i": account})
        self.node.start()
        return self

    def close(self) -> None:
        if self.node is not None:
            self.node.close()
            self.node = None

    def open_here(self, tx, account: str) -> None:
        tx.connection("app").execute(sa.text("INSERT INTO accounts (id, status) VALUES (:i, 'open')"), {"i": account})


def make_banks(request: Any, folder: Path, made: list[Bank]) -> Callable[..., dict[str, Bank]]:
    """Factory: make(spec, limits="", before_start=None, start=True) -> {role: Bank}. ``spec``: role ->
    (kind, coupling); kind "pg" or "maria" (a database on the session's servers) or a server object of the
    test's own (``create_database``). Every node gets ``limits`` ("key = value" lines of [limits]);
    ``before_start(urls)`` runs once the databases exist."""
    def make(spec: dict[str, tuple[Any, str]], limits: str = "", before_start: Callable[..., Any] | None = None,
             start: bool = True) -> dict[str, Bank]:
        urls = {role: request.getfixturevalue("pg_db" if kind == "pg" else "maria_db")(role) if isinstance(kind, str)
                else kind.create_database(f"{role}_{os.urandom(3).hex()}") for role, (kind, _) in spec.items()}
        for url in urls.values():
            accounts_schema(url)
        if before_start is not None:
            before_start(urls)
        ids = node_ids(list(spec))
        configs = write_configs(folder, urls, ids, limits=limits)
        result = {role: Bank(configs[role], urls[role], spec[role][1]) for role in spec}
        for role, bank in result.items():
            bank.id = ids[role]
        made.extend(result.values())
        if start:
            for bank in result.values():
                bank.start()
        return result
    return make
