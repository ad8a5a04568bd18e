"""Xid: validation and the round trips to the PostgreSQL gid and the MySQL xid literal."""

import psycopg2
import pytest
from hypothesis import given, strategies as st

from qtp.errors import ConfigurationError
from qtp.xa import FORMAT_ID, Xid

parts = st.binary(min_size=1, max_size=64)


@given(st.integers(0, 2**31 - 1), parts, parts)
def test_pg_gid_round_trip(format_id, gtrid, bqual):
    xid = Xid(format_id, gtrid, bqual)
    assert Xid.from_pg_gid(xid.to_pg_gid()) == xid


@given(st.integers(0, 2**31 - 1), parts, parts)
def test_mysql_literal_round_trip(format_id, gtrid, bqual):
    xid = Xid(format_id, gtrid, bqual)
    assert Xid.from_mysql(xid.to_mysql()) == xid
    data = gtrid + bqual
    assert Xid.from_mysql_parts(format_id, len(gtrid), len(bqual), data) == xid


def test_gid_matches_psycopg2(pg_db):
    """qtp computes gids itself for recovery; they must be byte-for-byte those psycopg2's TPC API writes."""
    from sqlalchemy.engine import make_url

    u = make_url(pg_db())
    conn = psycopg2.connect(host=u.host, port=u.port, user=u.username, dbname=u.database)
    xid = Xid.of(Xid.new_gtrid("node-1"), "app")
    conn.tpc_begin(conn.xid(xid.format_id, xid.gtrid.decode(), xid.bqual.decode()))
    with conn.cursor() as cur:
        cur.execute("SELECT 1")
    conn.tpc_prepare()
    other = psycopg2.connect(host=u.host, port=u.port, user=u.username, dbname=u.database)
    with other.cursor() as cur:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
        gids = [row[0] for row in cur.fetchall()]
    other.close()
    conn.tpc_rollback()
    conn.close()
    assert gids == [xid.to_pg_gid()]


def test_new_xid_carries_node_and_branch():
    xid = Xid.of(Xid.new_gtrid("orders-1"), "ledger")
    assert xid.format_id == FORMAT_ID
    assert xid.node_id == "orders-1"
    assert xid.branch == "ledger"
    assert xid.belongs_to("orders-1") and not xid.belongs_to("orders-2")
    assert len(xid.gtrid) <= 64


def test_foreign_xids_are_not_qtps():
    assert Xid(1, b"orders-1/abc", b"x").belongs_to("orders-1") is False
    assert Xid.from_pg_gid("hand-made") is None
    assert Xid.from_pg_gid("12_notbase64!_x") is None
    assert Xid.from_mysql("'abc','',1") is None


@pytest.mark.parametrize("bad", ["", "a b", "x" * 32, "ünïcode", "a/b"])
def test_node_id_is_validated(bad):
    with pytest.raises(ConfigurationError, match="invalid node id"):
        Xid.new_gtrid(bad)


@pytest.mark.parametrize("kwargs", [dict(format_id=-1, gtrid=b"a", bqual=b"b"),
                                    dict(format_id=1, gtrid=b"", bqual=b"b"),
                                    dict(format_id=1, gtrid=b"a", bqual=b"b" * 65),
                                    dict(format_id=1, gtrid="a", bqual=b"b")])
def test_xid_parts_are_validated(kwargs):
    with pytest.raises(ValueError):
        Xid(**kwargs)


def test_xid_is_frozen():
    xid = Xid(1, b"a", b"b")
    with pytest.raises(AttributeError):
        xid.gtrid = b"c"
