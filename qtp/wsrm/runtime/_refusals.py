"""Warnings about refused requests, at most a few lines a minute per reason.

A stranger who floods a node with unsigned requests, or a peer who keeps touching another's sequences, must
not grow the node's log without limit (160,510 lines, 28 MB, in a few minutes before this module). Per reason
(``unauthenticated``, ``not_owner``, ``create``, ``unknown_action``, ``connections``) the first refusal is
logged with its detail; the ones that follow within ``interval`` seconds are only counted, and the next
refusal after it logs one summary line ("refused 15,234 more unauthenticated requests in the last 60 s")
before its own detail. The metric ``qtp_requests_refused_total`` still counts every refusal: the sites
increment it themselves.
"""

from __future__ import annotations

from qtp._failures import RefusalWarnings  # noqa: F401 - the class lives beside Failures; the sites import it here

refusals = RefusalWarnings()  # the process's one node shares it: the log it limits is the process's
# what a database out of reach makes every loop and request say (a store, a lease, recovery): the first of each
# kind with its detail, then a count a minute (a 75 s outage of a 4-slot replica's database wrote 7,066 lines)
outages = RefusalWarnings(summary="%s more times: %s (in the last %.0f s)")
