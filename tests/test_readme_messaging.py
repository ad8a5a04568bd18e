"""The README's "Sending and receiving messages" runs as written: its two qtp.toml files and its two Python
blocks, with only the database URLs and ports replaced by this test's own."""

from __future__ import annotations

import re
import time
import tomllib
from pathlib import Path

import pytest

import qtp
from qtp.embedded import free_port
from qtp.testing.nodes import create, rows

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> dict[str, str]:
    """Code blocks of the section, by the file name on their first line (``# client.toml``)."""
    text = README.read_text()
    section = text[text.index("## Sending and receiving messages"):text.index("## Reconciliation (Spark)")]
    blocks = {}
    for body in re.findall(r"```(?:python|toml)\n(.*?)```", section, flags=re.S):
        first = body.splitlines()[0]
        if first.startswith("# ") and "." in first:
            blocks[first[2:].split()[0]] = body
    return blocks


@pytest.mark.parametrize("client_toml", ["client.toml", "client-polling.toml"])
def test_readme_example_sends_and_applies_one_order(pg_db, maria_db, tmp_path, monkeypatch, client_toml):
    """With client-polling.toml the same client.py runs without an endpoint (no HTTP server): the server's
    reply is fetched with WS-MakeConnection and acknowledged, so nothing is left waiting at the server."""
    blocks = _blocks()
    assert set(blocks) >= {"client.py", "shop_server.py", "client.toml", "client-polling.toml", "server.toml"}
    pg_url, maria_url = pg_db("client"), maria_db("server")
    create(pg_url, "CREATE TABLE orders (id int PRIMARY KEY)")
    create(maria_url, "CREATE TABLE applied (order_id int NOT NULL)")
    ports = {"8001": str(free_port()), "8002": str(free_port())}

    def local(text: str) -> str:
        text = text.replace("postgresql://app@db1/shop", pg_url).replace("mysql+pymysql://app@db2/shop", maria_url)
        for old, new in ports.items():
            text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
        return text

    (tmp_path / "client.toml").write_text(local(blocks[client_toml]))
    (tmp_path / "server.toml").write_text(local(blocks["server.toml"]))
    polling = "endpoint" not in tomllib.loads(blocks[client_toml])["node"]
    assert polling is (client_toml == "client-polling.toml")
    monkeypatch.chdir(tmp_path)
    server: dict = {}
    client: dict = {}
    exec(compile(blocks["shop_server.py"], "README:shop_server.py", "exec"), server)
    server["node"].start()  # what `qtp serve --app shop_server:node` does after importing it
    try:
        exec(compile(blocks["client.py"], "README:client.py", "exec"), client)

        def waiting() -> bool:  # the order not applied yet, or (polling) its reply not yet fetched
            return rows(maria_url, "SELECT COUNT(*) FROM applied")[0][0] < 1 or \
                (polling and rows(maria_url, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0] > 0)

        deadline = time.monotonic() + 30
        while waiting() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rows(maria_url, "SELECT order_id FROM applied") == [(42,)]
        assert rows(pg_url, "SELECT id FROM orders") == [(42,)]
        assert client["tx"].outcome is qtp.Outcome.COMMITTED
        if polling:
            node = client["node"]
            assert node.endpoint is None and node._server is None and node.mc_address.startswith(
                "http://docs.oasis-open.org/ws-rx/wsmc/200702/anonymous?id=")
            assert rows(maria_url, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0] == 0  # fetched, acknowledged
    finally:
        if "node" in client:
            client["node"].close()
        server["node"].close()
        qtp.install(None)
