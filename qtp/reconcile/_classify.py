"""The classification, as small DataFrame -> DataFrame functions.

Every key seen on either side gets exactly one class, decided in this order::

    not on the client                                   unexpected       (the server has it; nobody sent it)
    client status in_doubt (or unrecognised)            in_doubt         (reported apart; not a violation)
    client aborted, server has it compensated           compensated      (applied, then undone: coupled messaging)
    client aborted, server has it                       applied_but_aborted
    client aborted, server does not                     ok
    client committed, server does not                   lost
    client committed, server has it 2+ times            duplicated       (histogram of the multiplicities)
    client committed, server has it compensated         committed_but_compensated
    client committed, once on the server, payload != mismatched       (counted per column as well)
    otherwise                                           ok

The frames between the functions have fixed shapes (the ``select`` at the edges is the contract):

- ``client_side``:  key, status, client (struct of the payload columns, named canonically)
- ``server_side``:  key, copies, server (struct of the same names and types as ``client``), compensated
  (every copy carries the server's compensation mark: coupled messaging undid it; False without a mark)
- ``classify``:     key, class, status, copies, client, server, differing (array of payload column names)
- ``summarize``:    class, copies, keys, one ``differs_<i>`` count per payload column, samples

Payload comparison is null-safe (``NULL`` equals ``NULL``). For a key the server holds several times, the
server payload shown is the smallest of its copies. ``summarize`` returns a frame whose size is bounded by
the number of classes times the distinct multiplicities, whatever the size of the tables, and holds at most
``sample_size`` sample rows per group (``min_by`` with ``k``), so only it is collected to the driver.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

OK = "ok"
LOST = "lost"
DUPLICATED = "duplicated"
UNEXPECTED = "unexpected"
MISMATCHED = "mismatched"
APPLIED_BUT_ABORTED = "applied_but_aborted"
IN_DOUBT = "in_doubt"
COMPENSATED = "compensated"
COMMITTED_BUT_COMPENSATED = "committed_but_compensated"
CLASSES = (OK, LOST, DUPLICATED, UNEXPECTED, MISMATCHED, APPLIED_BUT_ABORTED, IN_DOUBT, COMPENSATED,
           COMMITTED_BUT_COMPENSATED)
VIOLATIONS = (LOST, DUPLICATED, UNEXPECTED, MISMATCHED, APPLIED_BUT_ABORTED, COMMITTED_BUT_COMPENSATED)

COMMITTED = "committed"
ABORTED = "aborted"


def client_side(df: DataFrame, key: str, columns: Sequence[tuple[str, str]], status_column: str | None) -> DataFrame:
    """One row per client row: key, normalised status, payload struct.

    ``columns`` pairs each canonical name with the client's column name. Without a status column every row
    is committed; a NULL status counts as in doubt.
    """
    status = (
        F.lower(F.trim(F.col(status_column).cast("string"))) if status_column else F.lit(COMMITTED)
    )
    return df.select(
        F.col(key).alias("key"),
        F.coalesce(status, F.lit(IN_DOUBT)).alias("status"),
        F.struct(*[F.col(source).alias(name) for name, source in columns]).alias("client"),
    )


def server_side(df: DataFrame, key: str, columns: Sequence[tuple[str, str]],
                compensated: tuple[str, str] | None = None) -> DataFrame:
    """One row per server key: how many copies the server holds and the (smallest) payload among them.
    ``compensated`` = (column, value): a row whose column holds value was undone by a compensation."""
    payload = F.struct(*[F.col(source).alias(name) for name, source in columns])
    mark = (F.coalesce(F.col(compensated[0]).cast("string") == F.lit(compensated[1]), F.lit(False))
            if compensated else F.lit(False))
    return (
        df.select(F.col(key).alias("key"), payload.alias("server"), mark.alias("mark"))
        .groupBy("key")
        .agg(F.count(F.lit(1)).alias("copies"), F.min("server").alias("server"), F.min("mark").alias("compensated"))
        .select("key", "copies", "server", "compensated")
    )


def server_side_grouped(df: DataFrame, key: str, columns: Sequence[tuple[str, str]], copies: str) -> DataFrame:
    """``server_side`` for a frame the database has already grouped by key (``copies`` counts the rows).

    The payload of a key held several times is then the column-wise minimum of its copies.
    """
    payload = F.struct(*[F.col(source).alias(name) for name, source in columns])
    return df.select(F.col(key).alias("key"), F.col(copies).cast("long").alias("copies"), payload.alias("server"),
                     F.lit(False).alias("compensated"))


def differing_columns(names: Sequence[str]) -> Column:
    """The payload columns whose client and server values differ (null-safe); empty unless both sides exist."""
    both_sides = F.col("client").isNotNull() & F.col("server").isNotNull()
    flags = [
        F.when(both_sides & ~F.col(f"client.{name}").eqNullSafe(F.col(f"server.{name}")), F.lit(name))
        for name in names
    ]
    if not flags:
        return F.array().cast("array<string>")
    return F.array_compact(F.array(*flags))


def classify(client: DataFrame, server: DataFrame, names: Sequence[str]) -> DataFrame:
    """Full outer join of both sides on the key, and the class of every key."""
    matched = client.withColumn("sent", F.lit(True)).join(server, on="key", how="full_outer")
    copies = F.coalesce(F.col("copies"), F.lit(0))
    differing = differing_columns(names)

    was_sent = F.col("sent").isNotNull()
    committed = F.col("status") == COMMITTED
    aborted = F.col("status") == ABORTED
    applied = copies >= 1
    applied_more_than_once = copies > 1
    payload_differs = F.size(differing) > 0
    undone = F.coalesce(F.col("compensated"), F.lit(False))

    cls = (
        F.when(~was_sent, F.lit(UNEXPECTED))
        .when(~(committed | aborted), F.lit(IN_DOUBT))
        .when(aborted & applied & undone, F.lit(COMPENSATED))
        .when(aborted & applied, F.lit(APPLIED_BUT_ABORTED))
        .when(aborted, F.lit(OK))
        .when(~applied, F.lit(LOST))
        .when(applied_more_than_once, F.lit(DUPLICATED))
        .when(undone, F.lit(COMMITTED_BUT_COMPENSATED))
        .when(payload_differs, F.lit(MISMATCHED))
        .otherwise(F.lit(OK))
    )
    return matched.select(
        "key",
        cls.alias("class"),
        "status",
        copies.alias("copies"),
        "client",
        "server",
        differing.alias("differing"),
    )


def summarize(classified: DataFrame, names: Sequence[str], sample_size: int) -> DataFrame:
    """Counts per (class, copies), per-column mismatch counts, and up to ``sample_size`` samples per group.

    The samples are the rows with the smallest keys of each group; ok keys carry no sample (their rows stay
    narrow through the aggregation's sort).
    """
    is_anomaly = F.col("class") != OK
    sample = F.when(is_anomaly, F.struct("key", "status", "copies", "client", "server", "differing"))
    per_column = [
        F.count_if(F.array_contains("differing", name)).alias(f"differs_{i}") for i, name in enumerate(names)
    ]
    return (
        classified.groupBy("class", "copies")
        .agg(
            F.count(F.lit(1)).alias("keys"),
            *per_column,
            F.min_by(sample, F.col("key"), sample_size).alias("samples"),
        )
        .select("class", "copies", "keys", *[f"differs_{i}" for i in range(len(names))], "samples")
    )


def anomalies(classified: DataFrame, names: Sequence[str]) -> DataFrame:
    """The non-ok keys, flattened to plain columns so that any JDBC table or Parquet file can hold them."""
    is_anomaly = F.col("class") != OK
    return classified.filter(is_anomaly).select(
        "key",
        "class",
        "status",
        "copies",
        *[F.col(f"client.{name}").alias(f"client_{name}") for name in names],
        *[F.col(f"server.{name}").alias(f"server_{name}") for name in names],
        F.array_join("differing", ",").alias("differing"),
    )
