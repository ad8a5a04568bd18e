"""``qtp reconcile``: the command line of the reconciliation job (also ``python -m qtp.reconcile``)."""

from __future__ import annotations

import argparse
import sys

from qtp.errors import ConfigurationError, QtpError

DESCRIPTION = """\
Reconcile what a client committed against what a server applied, on Spark over JDBC.

Every key is classified as ok, lost (committed by the client, absent on the server), duplicated (applied
more than once; histogram of the multiplicities), unexpected (on the server, never sent), mismatched
(payload differs; counted per column), applied_but_aborted (rolled back by the client, present on the
server) or in_doubt (the client's status is in_doubt; reported apart). The verdict is exactly-once when
lost, duplicated, unexpected, mismatched and applied_but_aborted are all 0.

URLs are SQLAlchemy URLs as in qtp.toml (postgresql://user@host:port/db, mysql+pymysql://user@host/db); the
JDBC URLs are derived from them and the driver jars are taken from Debian's libpostgresql-jdbc-java and
libmariadb-java (/usr/share/java).
"""

EPILOG = """\
column mapping: --key and each --columns entry is either NAME (same name on both sides) or
CLIENT=SERVER, e.g. --key id=msg_id --columns amount=amt,note.

exit codes: 0 exactly-once, 1 violated, 2 bad input (unknown table or column, mismatched key types,
unreachable database, missing JDBC jar) or a failed Spark job.

example:
  qtp reconcile --client-url postgresql://postgres@127.0.0.1:5432/app --client-table outbox \\
      --server-url mysql+pymysql://root@127.0.0.1:3306/app --server-table applied \\
      --key id=msg_id --columns amount=amt,note --client-status-column status \\
      --json report.json --html report.html --master local[*] --conf spark.driver.memory=2g
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reconcile", help="prove exactly-once delivery: client table vs server table on Spark",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("tables")
    src.add_argument("--client-url", required=True, metavar="URL", help="SQLAlchemy URL of the client database")
    src.add_argument("--client-table", required=True, metavar="T", help="client table ([schema.]table)")
    src.add_argument("--server-url", required=True, metavar="URL", help="SQLAlchemy URL of the server database")
    src.add_argument("--server-table", required=True, metavar="T", help="server table ([schema.]table)")
    src.add_argument("--key", required=True, metavar="COL", help="message key: COL, or CLIENT_COL=SERVER_COL")
    src.add_argument("--columns", default="", metavar="COL[,COL...]",
                     help="payload columns compared on both sides: COL or CLIENT_COL=SERVER_COL, comma-separated")
    src.add_argument("--client-status-column", metavar="COL",
                     help="client column holding committed / aborted / in_doubt (default: all committed)")
    src.add_argument("--server-compensated", metavar="COL=VALUE",
                     help="server rows whose COL holds VALUE were undone by a compensation (coupled messaging): "
                          "for an aborted client row they are the class 'compensated', for a committed one a "
                          "violation ('committed_but_compensated')")
    out = p.add_argument_group("reports")
    out.add_argument("--json", metavar="FILE", help="write the JSON report (counts, verdict, samples, metadata)")
    out.add_argument("--html", metavar="FILE", help="write the HTML report; its chart goes to FILE's name + .png")
    out.add_argument("--anomalies-parquet", metavar="DIR", help="write the per-key anomalies as Parquet")
    out.add_argument("--anomalies-url", metavar="URL", help="database for --anomalies-table (default: client URL)")
    out.add_argument("--anomalies-table", metavar="T", help="write the per-key anomalies to this table (replaced)")
    out.add_argument("--samples", type=int, default=10, metavar="N", help="sample keys per class (default 10)")
    run_ = p.add_argument_group("spark")
    run_.add_argument("--master", metavar="M", help="Spark master (default local[*], or spark-submit's)")
    run_.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                      help="Spark configuration, repeatable (e.g. spark.driver.memory=2g)")
    run_.add_argument("--partitions", type=int, metavar="N",
                      help="parallel JDBC reads per table (default twice Spark's parallelism)")
    run_.add_argument("--fetchsize", type=int, default=10_000, metavar="N",
                      help="rows per JDBC round trip (cursor on PostgreSQL, streaming on MariaDB; default 10000)")
    run_.add_argument("--mode", choices=("auto", "digest", "full"), default="auto",
                      help="digest: the databases digest ranges of keys and only differing ranges are read; "
                           "full: read every row; auto (default): digest when the column types allow it")
    push = run_.add_mutually_exclusive_group()
    push.add_argument("--pushdown", action="store_true", default=None,
                      help="group the server's rows by key in its database (default for a PostgreSQL server)")
    push.add_argument("--no-pushdown", dest="pushdown", action="store_false",
                      help="group the server's rows by key in Spark (default for a MariaDB/MySQL server)")
    run_.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _pair(text: str, what: str) -> tuple[str, str]:
    left, sep, right = text.strip().partition("=")
    if not left or (sep and not right):
        raise ConfigurationError(f"bad {what} {text!r}: write NAME or CLIENT_NAME=SERVER_NAME")
    return left.strip(), (right.strip() if sep else left.strip())


def _conf(items: list[str]) -> dict[str, str]:
    conf = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"bad --conf {item!r}: write KEY=VALUE, e.g. spark.driver.memory=2g")
        conf[key.strip()] = value.strip()
    return conf


def run(args: argparse.Namespace) -> int:
    from qtp.reconcile import require_spark

    require_spark()
    from qtp.reconcile._job import _stderr_log, reconcile
    from qtp.reconcile._report import summary_table, write_html, write_json
    from qtp.reconcile._sources import TableSpec

    client_key, server_key = _pair(args.key, "--key")
    pairs = [_pair(item, "--columns entry") for item in args.columns.split(",") if item.strip()]
    client = TableSpec(args.client_url, args.client_table, client_key, tuple(c for c, _ in pairs),
                       args.client_status_column)
    compensated = None
    if args.server_compensated:
        column, sep, value = args.server_compensated.partition("=")
        if not column.strip() or not sep:
            raise ConfigurationError(f"bad --server-compensated {args.server_compensated!r}: write COLUMN=VALUE")
        compensated = (column.strip(), value)
    server = TableSpec(args.server_url, args.server_table, server_key, tuple(s for _, s in pairs),
                       compensated=compensated)
    anomalies_table = None
    if args.anomalies_table:
        anomalies_table = (args.anomalies_url or args.client_url, args.anomalies_table)
    result = reconcile(
        client, server, master=args.master, spark_conf=_conf(args.conf), partitions=args.partitions,
        fetchsize=args.fetchsize, sample_size=args.samples, anomalies_parquet=args.anomalies_parquet,
        anomalies_table=anomalies_table, mode=args.mode, pushdown=args.pushdown,
        log=None if args.quiet else _stderr_log,
    )
    print(summary_table(result))
    if args.json:
        write_json(result, args.json)
        print(f"JSON report: {args.json}")
    if args.html:
        png = write_html(result, args.html)
        print(f"HTML report: {args.html} (chart {png})")
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m qtp.reconcile`` and ``spark-submit qtp/reconcile/__main__.py``."""
    parser = argparse.ArgumentParser(
        prog="qtp reconcile", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--traceback", action="store_true", help="show the full stack on errors")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except QtpError as exc:
        if args.traceback:
            raise
        print(f"qtp reconcile: error: {exc}", file=sys.stderr)
        return 2
