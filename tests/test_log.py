"""The decision log: durability of decisions, torn tails, corruption, group commit, checkpoints, the lock."""

import os
import threading
import time

import pytest

from qtp.coordinator import DecisionLog, lock_holder, read_log
from qtp.coordinator._log import COMMIT, encode_record
from qtp.errors import LogCorruptError, LogLockedError


def test_decisions_without_end_survive_reopen(tmp_path):
    log = DecisionLog(tmp_path)
    log.log_commit("n/1", ["a", "b"])
    log.log_commit("n/2", ["a", "c"])
    log.log_end("n/1")
    log.close()
    assert read_log(tmp_path).open == {"n/2": ["a", "c"]}
    reopened = DecisionLog(tmp_path)
    assert reopened.open == {"n/2": ["a", "c"]}
    reopened.close()


def test_forced_record_is_synced_before_log_commit_returns(tmp_path):
    synced = []

    def sync(fd):
        os.fdatasync(fd)
        synced.append(read_log(tmp_path).open)  # what was written when the sync ran

    log = DecisionLog(tmp_path, sync=sync)
    log.log_commit("n/1", ["a", "b"])
    assert synced == [{"n/1": ["a", "b"]}]  # the record was written, then synced, before the call returned
    log.close()


def test_a_failed_write_is_never_reported_durable_and_blocks_recovery_in_process(tmp_path):
    from qtp.errors import LogError

    def broken(fd):
        raise OSError(5, "Input/output error")

    log = DecisionLog(tmp_path, sync=broken)
    with pytest.raises(LogError, match="Input/output error"):
        log.log_commit("n/1", ["a", "b"])
    with pytest.raises(LogError, match="restart the node"):
        log.open  # what reached the disk is unknown: only a fresh read after a restart may be trusted
    with pytest.raises(LogError):
        log.log_commit("n/2", ["a", "b"])


def test_a_failed_checkpoint_keeps_the_decisions_durable(tmp_path, monkeypatch):
    log = DecisionLog(tmp_path, segment_bytes=64)

    def no_space(number):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(log, "_start_segment", no_space)
    log.log_commit("n/1", ["a", "b"])  # the rotation after this write fails; the commit must not
    log.log_commit("n/2", ["a", "b"])
    assert not log.failed
    log.close()
    assert read_log(tmp_path).open == {"n/1": ["a", "b"], "n/2": ["a", "b"]}


def _segment(tmp_path):
    (segment,) = sorted(tmp_path.glob("segment-*.log"))
    return segment


def test_torn_tail_is_ignored_and_truncated(tmp_path):
    log = DecisionLog(tmp_path)
    log.log_commit("n/1", ["a", "b"])
    log.close()
    segment = _segment(tmp_path)
    good_size = segment.stat().st_size
    torn = encode_record(COMMIT, {"gtrid": "n/2", "branches": ["a", "b"]})
    with open(segment, "ab") as f:
        f.write(torn[: len(torn) // 2])  # the crash cut this write short
    state = read_log(tmp_path)
    assert state.open == {"n/1": ["a", "b"]}
    assert state.torn_tail == (segment, good_size)
    log = DecisionLog(tmp_path)  # truncates the tail, then appends after the last good record
    log.log_commit("n/3", ["a", "b"])
    log.close()
    assert read_log(tmp_path).open == {"n/1": ["a", "b"], "n/3": ["a", "b"]}
    assert read_log(tmp_path).torn_tail is None


def test_bad_checksum_on_the_last_record_is_a_torn_tail(tmp_path):
    log = DecisionLog(tmp_path)
    log.log_commit("n/1", ["a", "b"])
    log.log_commit("n/2", ["a", "b"])
    log.close()
    segment = _segment(tmp_path)
    data = bytearray(segment.read_bytes())
    data[-3] ^= 0xFF
    segment.write_bytes(bytes(data))
    assert read_log(tmp_path).open == {"n/1": ["a", "b"]}


def test_corrupt_record_in_the_middle_is_refused_with_file_and_offset(tmp_path):
    log = DecisionLog(tmp_path)
    log.log_commit("n/1", ["a", "b"])
    offset = log._size
    log.log_commit("n/2", ["a", "b"])
    log.log_commit("n/3", ["a", "b"])
    log.close()
    segment = _segment(tmp_path)
    data = bytearray(segment.read_bytes())
    data[offset + 12] ^= 0xFF  # inside the body of the n/2 record
    segment.write_bytes(bytes(data))
    with pytest.raises(LogCorruptError, match=rf"{segment}.*offset {offset}"):
        read_log(tmp_path)
    with pytest.raises(LogCorruptError):
        DecisionLog(tmp_path)


def test_concurrent_committers_share_fsyncs(tmp_path):
    syncs = []

    def slow_sync(fd):  # a disk with 2 ms fsync latency makes the batching visible and certain
        time.sleep(0.002)
        os.fdatasync(fd)
        syncs.append(1)

    log = DecisionLog(tmp_path, sync=slow_sync)
    threads, per_thread = 16, 25

    def committer(t):
        for i in range(per_thread):
            log.log_commit(f"n/{t}-{i}", ["a", "b"])

    workers = [threading.Thread(target=committer, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    log.close()
    decisions = threads * per_thread
    assert log.forced_records == decisions
    assert len(read_log(tmp_path).open) == decisions  # every acknowledged decision is on disk
    assert log.decisions_per_fsync >= 4, f"{decisions} decisions took {log.fsyncs} fsyncs"


def test_end_records_are_not_forced(tmp_path):
    syncs = []
    log = DecisionLog(tmp_path, sync=lambda fd: (syncs.append(fd), os.fdatasync(fd)))
    log.log_commit("n/1", ["a", "b"])
    forced = len(syncs)
    log.log_end("n/1")
    assert len(syncs) == forced
    assert read_log(tmp_path).open == {"n/1": ["a", "b"]}  # not yet written: recovery would re-commit
    log.close()  # close flushes
    assert read_log(tmp_path).open == {}


def test_checkpoints_bound_the_log(tmp_path):
    log = DecisionLog(tmp_path, segment_bytes=4096, sync=lambda fd: None)  # what is bounded, not what is durable
    for i in range(2000):
        log.log_commit(f"n/{i}", ["a", "b"])
        if i % 100 != 7:  # leave some decisions open across many checkpoints
            log.log_end(f"n/{i}")
    log.close()
    state = read_log(tmp_path)
    assert state.open == {f"n/{i}": ["a", "b"] for i in range(2000) if i % 100 == 7}
    assert len(state.segments) == 1
    assert state.size < 4096 + 4096
    assert state.last_checkpoint == int(state.segments[0].stem.split("-")[1]) > 1


def test_lock_stops_a_second_manager(tmp_path):
    log = DecisionLog(tmp_path)
    assert lock_holder(tmp_path) == str(os.getpid())
    with pytest.raises(LogLockedError, match="in use by a live transaction manager"):
        DecisionLog(tmp_path)
    log.close()
    assert lock_holder(tmp_path) is None
    DecisionLog(tmp_path).close()


def test_leader_holds_the_batch_open_for_transactions_still_voting(tmp_path):
    """Decisions of transactions that were voting when the leader arrived ride on the leader's fsync."""
    log = DecisionLog(tmp_path, group_window_s=5.0)  # generous: the voters, not the clock, end the wait
    voters = 8
    for _ in range(voters):
        log.voting(+1)

    def voter(i):
        time.sleep(0.01 * i)  # votes come back at different times
        log.voting(-1)
        log.log_commit(f"n/{i}", ["a", "b"])

    workers = [threading.Thread(target=voter, args=(i,)) for i in range(voters)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert log.forced_records == voters
    assert log.fsyncs == 1
    log.close()


def test_lone_transaction_does_not_wait_for_the_window(tmp_path):
    log = DecisionLog(tmp_path, group_window_s=5.0)
    began = time.monotonic()
    log.log_commit("n/1", ["a", "b"])
    assert time.monotonic() - began < 1.0
    log.close()
