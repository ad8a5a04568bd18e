"""pymysql's default TLS mode (PREFERRED) built a new default SSL context, loading the system's CA bundle, for
every connection (about 30 ms of CPU each here); qtp's MySQL engines share one (qtp.xa.share_tls_context)."""

from __future__ import annotations

import sqlalchemy

from qtp.xa import resource_for, share_tls_context
from qtp.xa._mysql import _Connection


def test_mysql_connections_share_one_preferred_tls_context_and_keep_explicit_settings(maria_db):
    url = maria_db("tls")
    resource = resource_for("app", url, "tls-node")
    first, second = resource.engine.raw_connection(), resource.engine.raw_connection()
    try:
        raw = [c.driver_connection for c in (first, second)]
        assert all(isinstance(c, _Connection) for c in raw)
        assert raw[0].ctx is raw[1].ctx and raw[0].ctx is not None
        assert raw[0]._ssl_required is False  # still PREFERRED: TLS only when the server offers it
        with resource.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1
    finally:
        first.close()
        second.close()
    explicit = raw[0]._create_ssl_ctx({"verify_mode": "required"})
    assert explicit is not raw[0].ctx  # explicit settings get a context of their own, as pymysql builds it
    engine = sqlalchemy.create_engine(url)
    assert share_tls_context(engine) is engine and share_tls_context(engine) is engine  # once per engine
    engine.dispose()
    resource.close()
