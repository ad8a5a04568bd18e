"""The decision log: an append-only, checksummed, group-committed file of commit decisions.

Why it exists (presumed abort). A global transaction commits only if every branch voted yes *and* the
decision "commit" survives any crash that follows. So the manager forces a COMMIT record to disk after the
last yes vote and before the first phase-2 commit: once it is on disk, recovery will finish the commit;
before it is on disk, no branch has committed, and recovery may roll every branch back. A transaction with
no COMMIT record is therefore presumed aborted, and aborts are never logged. When every branch has
committed an END record is appended, unforced: losing it only makes recovery re-commit, which is
idempotent.

Group commit. Concurrent committers append their records to one buffer; the first to need durability
becomes the leader, writes the whole buffer and calls ``fdatasync`` once, then wakes the others. One fsync
thus carries the decisions of every transaction that arrived while the previous one ran.

Made versus durable. A COMMIT record that has been appended to the buffer will reach the disk with the
next flush, whoever runs it, so from the instant of the append the decision must be treated as made, even
if its committer is interrupted while it waits: ``holds(gtrid)`` says whether a decision is appended
(buffered, being written, or durable). ``open`` lists only durable decisions. A write or sync that fails,
or is cut by an exception of any kind, fails the log for good: what reached the disk is then unknown,
and only a recovery that reads the log afresh (after a restart) may act on it.

Format. Segment files ``segment-NNNNNNNN.log``; each record is::

    u32 length of body | u32 crc32 of body | body = u8 type + JSON payload

A record that runs past the end of the last segment, or fails its checksum as the very last record there,
is a torn tail (the write was cut by a crash) and is dropped. A bad record anywhere else is corruption:
the log refuses to load and names the file and offset, because guessing could turn a commit into an
abort.

Checkpoints. When the active segment grows past ``segment_bytes`` the leader starts a new segment whose
first record lists every decision still without an END, makes it durable, and deletes the older segments.

Lock. ``LOCK`` in the log directory is held with ``flock`` by the live manager; a second manager, or an
operator's ``qtp recover``, sees it and stops.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from qtp.coordinator.failpoints import failpoint
from qtp.errors import LogCorruptError, LogError, LogLockedError

log = logging.getLogger("qtp.coordinator")

_HEADER = struct.Struct("<II")
COMMIT, END, CHECKPOINT = 1, 2, 3
_TYPE_NAMES = {COMMIT: "commit", END: "end", CHECKPOINT: "checkpoint"}
_MAX_RECORD = 16 * 1024 * 1024


def encode_record(kind: int, payload: dict) -> bytes:
    body = bytes([kind]) + json.dumps(payload, separators=(",", ":")).encode()
    return _HEADER.pack(len(body), zlib.crc32(body)) + body


@dataclass
class LogState:
    """What a log says: the decisions without an END record, in the order they were made."""

    open: dict[str, list[str]] = field(default_factory=dict)  # gtrid -> branch names
    segments: list[Path] = field(default_factory=list)
    size: int = 0
    records: int = 0
    last_checkpoint: int | None = None  # segment number of the newest checkpoint
    torn_tail: tuple[Path, int] | None = None  # where a torn tail was cut off


def _segment_number(path: Path) -> int:
    return int(path.stem.split("-")[1])


def _segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("segment-*.log"), key=_segment_number)


def read_log(directory: Path | str) -> LogState:
    """Read every segment and return the open decisions. Raises LogCorruptError on damage (not a torn tail)."""
    directory = Path(directory)
    state = LogState(segments=_segments(directory))
    for index, path in enumerate(state.segments):
        last = index == len(state.segments) - 1
        _read_segment(path, state, last)
    return state


def _read_segment(path: Path, state: LogState, last: bool) -> None:
    data = path.read_bytes()
    state.size += len(data)
    offset = 0
    while offset < len(data):
        problem, torn = _check_record(data, offset)
        if problem is not None:
            if last and torn:
                state.torn_tail = (path, offset)
                return
            raise LogCorruptError(
                f"decision log {path} is damaged at offset {offset} ({problem}); qtp will not guess the "
                "outcome of the transactions recorded there: restore the file from a backup, or resolve "
                "the in-doubt branches by hand and move the damaged log aside"
            )
        length, _ = _HEADER.unpack_from(data, offset)
        end = offset + _HEADER.size + length
        body = data[offset + _HEADER.size:end]
        _apply(state, body, path)
        state.records += 1
        offset = end


def _check_record(data: bytes, offset: int) -> tuple[str | None, bool]:
    """(problem, could it be a torn tail?) for the record at ``offset``; (None, False) when it is sound.

    A crash can only cut the last write short, so a bad record counts as torn only where nothing follows
    it: it runs to or past the end of the file, or everything after it is zero bytes.
    """
    if offset + _HEADER.size > len(data):
        return "truncated header", True
    length, crc = _HEADER.unpack_from(data, offset)
    end = offset + _HEADER.size + length
    if length == 0 or length > _MAX_RECORD:
        return f"impossible record length {length}", not any(data[offset:])
    if end > len(data):
        return "record runs past the end of the file", True
    if zlib.crc32(data[offset + _HEADER.size:end]) != crc:
        return "checksum mismatch", end == len(data) or not any(data[end:])
    return None, False


def _apply(state: LogState, body: bytes, path: Path) -> None:
    kind = body[0]
    payload = json.loads(body[1:])
    if kind == COMMIT:
        state.open[payload["gtrid"]] = payload["branches"]
    elif kind == END:
        state.open.pop(payload["gtrid"], None)
    elif kind == CHECKPOINT:
        state.open = {gtrid: branches for gtrid, branches in payload["open"]}
        state.last_checkpoint = _segment_number(path)
    else:
        raise LogCorruptError(f"decision log {path} holds a record of unknown type {kind}")


class DecisionLog:
    """The live, locked log of one node. ``log_commit`` is forced (group commit); ``log_end`` is not."""

    def __init__(self, directory: Path | str, segment_bytes: int = 8 * 1024 * 1024,
                 sync: Callable[[int], None] = os.fdatasync, group_window_s: float = 0.002):
        self.directory = Path(directory)
        self._sync = sync
        self.group_window_s = group_window_s
        self._voting = 0  # transactions in phase 1 now: they will want a decision forced soon
        self.directory.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self._lock_fd = _acquire_lock(self.directory)
        try:
            state = read_log(self.directory)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._open: dict[str, list[str]] = state.open
        self.recovered = state
        self._cond = threading.Condition()
        self._pending: list[tuple[int, str, list[str] | None, bytes]] = []  # (kind, gtrid, branches, record)
        self._writing: list[tuple[int, str, list[str] | None, bytes]] = []  # the batch a leader is writing
        self._appended = 0
        self._durable = 0
        self._flushing = False
        self._failed: BaseException | None = None
        self.fsyncs = 0
        self.forced_records = 0
        self._open_active(state)

    def _open_active(self, state: LogState) -> None:
        if state.torn_tail is not None:
            path, offset = state.torn_tail
            with open(path, "r+b") as f:
                f.truncate(offset)
                os.fsync(f.fileno())
        if state.segments:
            self._segment = state.segments[-1]
            self._fd = os.open(self._segment, os.O_WRONLY | os.O_APPEND)
            self._size = os.fstat(self._fd).st_size
        else:
            self._start_segment(1)

    def _start_segment(self, number: int) -> None:
        """Create segment ``number``, opening with a checkpoint of the open decisions, and make it current.
        On failure nothing changes: the partial file is removed and the current segment stays."""
        with self._cond:
            still_open = [[g, b] for g, b in self._open.items()]
        path = self.directory / f"segment-{number:08d}.log"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            record = encode_record(CHECKPOINT, {"open": still_open})
            os.write(fd, record)
            os.fdatasync(fd)
            _fsync_dir(self.directory)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._segment, self._fd, self._size = path, fd, len(record)

    @property
    def open(self) -> dict[str, list[str]]:
        """The commit decisions without an END record (gtrid -> branch names).

        Raises LogError once a write has failed: what is on disk is then unknown, and only a recovery that
        reads the log afresh (after a restart) may act on it.
        """
        if self._failed is not None:
            raise LogError(f"decision log {self.directory} failed ({self._failed}); restart the node so that "
                           "recovery reads what reached the disk") from self._failed
        return self._open

    @property
    def failed(self) -> bool:
        return self._failed is not None

    @property
    def failure(self) -> str | None:
        """What made the log fail, or None."""
        return None if self._failed is None else repr(self._failed)

    # ------------------------------------------------------------------ writing

    def log_commit(self, gtrid: str, branches: list[str]) -> None:
        """Force the commit decision for ``gtrid`` to disk; returns once it is durable.

        The decision counts as made from the append on (see ``holds``): an exception that interrupts the
        wait leaves the record to the next flush.
        """
        entry = (COMMIT, gtrid, list(branches), encode_record(COMMIT, {"gtrid": gtrid, "branches": branches}))
        with self._cond:
            self._check_usable()
            self._pending.append(entry)  # one operation: an interrupt leaves it either appended or not
            self._appended += 1
            ticket = self._appended
            failpoint("decision_appended")
            if self._flushing:
                self._cond.notify_all()  # a leader may be holding the batch open for us
            while self._durable < ticket:
                self._check_usable()
                if self._flushing:
                    self._cond.wait()
                else:
                    self._lead_flush()
            self.forced_records += 1

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise LogError(f"decision log {self._segment} cannot be written: {self._failed}; restart the node "
                           "so that recovery reads what reached the disk") from self._failed

    def holds(self, gtrid: str) -> bool:
        """Whether a COMMIT decision for ``gtrid`` is appended: buffered, being written, or durable."""
        with self._cond:
            return gtrid in self._open or any(
                kind == COMMIT and g == gtrid for kind, g, _, _ in (*self._pending, *self._writing))

    def log_end(self, gtrid: str) -> None:
        """Note that every branch of ``gtrid`` committed. Unforced: it rides on the next flush."""
        with self._cond:
            if not self._failed and self.holds(gtrid):
                self._pending.append((END, gtrid, None, encode_record(END, {"gtrid": gtrid})))
                self._appended += 1

    def voting(self, delta: int) -> None:
        """The manager's note that a transaction started (+1) or finished (-1) asking its branches to vote."""
        with self._cond:
            self._voting += delta
            if delta < 0:
                self._cond.notify_all()

    def _lead_flush(self) -> None:
        """Called with the condition held; writes and syncs the buffer with the condition released.

        While other transactions are still voting, their decisions will arrive within a round trip: the
        leader holds the batch open for them, at most ``group_window_s`` (PostgreSQL's commit_delay with
        commit_siblings, in effect). A lone transaction never waits.

        Whatever happens in here, an interrupt included, the leader's flag is cleared and the waiters are
        woken on the way out; a write cut by any exception fails the log (the bytes on disk are unknown).
        """
        self._flushing = True
        try:
            if self._voting > 0 and self.group_window_s > 0:
                deadline = time.monotonic() + self.group_window_s
                while self._voting > 0:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
            self._writing, self._pending = self._pending, []
            upto = self._appended
            self._cond.release()
            try:
                self._write(b"".join(entry[3] for entry in self._writing))
            except BaseException as exc:  # the waiters see the failure and raise LogError
                self._failed = exc
                if not isinstance(exc, Exception):
                    raise  # an interrupt goes on up once the flag is cleared
                return
            finally:
                self._cond.acquire()
            for kind, gtrid, branches, _ in self._writing:  # durable now: what recovery may act on
                if kind == COMMIT:
                    self._open[gtrid] = branches
                else:
                    self._open.pop(gtrid, None)
            self._writing = []
            self._durable = upto
            if self._size > self.segment_bytes:
                self._cond.release()
                try:
                    self._try_checkpoint()
                finally:
                    self._cond.acquire()
        finally:
            self._flushing = False
            self.fsyncs += 1
            self._cond.notify_all()

    def _write(self, data: bytes) -> None:
        failpoint("log_write")
        os.write(self._fd, data)
        self._sync(self._fd)
        self._size += len(data)

    def _try_checkpoint(self) -> None:
        """A checkpoint is housekeeping: when it fails the log keeps growing in the current segment and
        the next flush tries again; the decisions already written stay durable."""
        try:
            self._checkpoint()
        except OSError as exc:
            log.error("decision log %s: checkpoint failed (%s); continuing in %s", self.directory, exc,
                      self._segment)

    def _checkpoint(self) -> None:
        """Start a new segment holding the open decisions, then drop the old segments."""
        old, old_fd = _segments(self.directory), self._fd
        self._start_segment(_segment_number(self._segment) + 1)
        os.close(old_fd)
        for path in old:
            path.unlink()
        _fsync_dir(self.directory)

    def flush(self) -> None:
        """Make every appended record durable (END records included)."""
        with self._cond:
            ticket = self._appended
            while self._durable < ticket and self._failed is None:
                if self._flushing:
                    self._cond.wait()
                else:
                    self._lead_flush()

    def checkpoint(self) -> None:
        """Force a checkpoint now (the log rotates to a new segment holding only open decisions)."""
        self.flush()
        with self._cond:
            while self._flushing:
                self._cond.wait()
            self._flushing = True
        try:
            self._checkpoint()
        finally:
            with self._cond:
                self._flushing = False
                self._cond.notify_all()

    def close(self) -> None:
        if self._lock_fd < 0:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)
            os.close(self._lock_fd)
            self._fd = self._lock_fd = -1

    @property
    def decisions_per_fsync(self) -> float:
        return self.forced_records / self.fsyncs if self.fsyncs else 0.0


# ---------------------------------------------------------------------- a log that was lost

LOST_MARK = "LOG_LOST"


def log_present(directory: Path | str) -> bool:
    """True when the directory holds at least one log segment. A manager creates its first segment when
    it opens the log, and a checkpoint writes the new segment before deleting old ones, so "no segment"
    means the log was never created or has been lost."""
    directory = Path(directory)
    return directory.is_dir() and any(directory.glob("segment-*.log"))


def read_lost_mark(directory: Path | str) -> dict | None:
    """The lost-log mark: ``{"created_at": epoch seconds, "vetted": [resource names]}``, or None.

    A manager that finds no log writes this mark, durably, *before* the log creates its first segment, so
    that neither a crash in between nor a restart while a resource is unreachable can make the new log
    look like the one that decided that resource's in-doubt branches. Recovery takes no presumed-abort
    decision on a resource until it has been vetted (its in-doubt branches from before ``created_at`` put
    in QUARANTINE); once every resource of the manager is vetted the mark is removed.
    """
    path = Path(directory) / LOST_MARK
    if not path.exists():
        return None
    return json.loads(path.read_text())


def write_lost_mark(directory: Path | str, mark: dict) -> None:
    """Write the mark atomically and durably (temporary file, fsync, rename, fsync of the directory)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_durably(directory / LOST_MARK, json.dumps(mark).encode())


def clear_lost_mark(directory: Path | str) -> None:
    path = Path(directory) / LOST_MARK
    if path.exists():
        path.unlink()
        _fsync_dir(path.parent)


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def append_durably(path: Path, lines: list[str]) -> None:
    """Append lines to a text file and make them durable (the file, and its directory entry when new)."""
    new = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(line + "\n" for line in lines).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _acquire_lock(directory: Path) -> int:
    path = directory / "LOCK"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise LogLockedError(
            f"decision log {directory} is in use by a live transaction manager (pid {owner}); a log serves one "
            "manager at a time: stop that process first, or give this manager its own node id / log_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def lock_holder(directory: Path | str) -> str | None:
    """The pid holding ``directory``'s log lock, or None when no live manager holds it."""
    path = Path(directory) / "LOCK"
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)
    return None
