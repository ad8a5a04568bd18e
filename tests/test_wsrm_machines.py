"""Unit tests of the RM Source, RM Destination and invoker machines, their tables and their diagrams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtp.errors import QtpError
from qtp.wsrm.protocol import (
    ALL_TABLES,
    AcceptMessage,
    AckReceived,
    AckRequestedReceived,
    CloseReceived,
    CloseRequested,
    CloseResponded,
    CompleteRequested,
    CreateRequested,
    CreateSequenceReceived,
    CreateSequenceResponded,
    CreateSequenceResponse,
    Deliver,
    DeliveryAborted,
    DeliveryCommitted,
    DeliveryFinished,
    DestinationRecord,
    DestinationSequence,
    DestinationState,
    FaultCode,
    FaultReceived,
    InvokerBuffer,
    InvokerRecord,
    InvokerState,
    MessageNumbered,
    MessageReceived,
    MessagesAcknowledged,
    MessagesLost,
    MessageStored,
    OfferAccepted,
    ProtocolError,
    RMVersion,
    SendAcknowledgement,
    SendAckRequested,
    SendCloseSequence,
    SendCloseSequenceResponse,
    SendCreateSequenceResponse,
    SendFault,
    SendRefused,
    SendRequested,
    SendTerminateSequence,
    SendTerminateSequenceResponse,
    SequenceAcknowledgement,
    SequenceCompleted,
    SequenceEnded,
    SetTimer,
    SourceRecord,
    SourceSequence,
    SourceState,
    TerminateReceived,
    TerminateResponded,
    TimerFired,
    Transmit,
    from_row,
    to_row,
    unknown_sequence,
)
from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.protocol.diagrams import render_all

ID = "urn:uuid:seq"
V10, V11 = RMVersion.WSRM10, RMVersion.WSRM11
DOCS = Path(__file__).resolve().parent.parent / "docs" / "wsrm"


def of(kind: type, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]


def untimed(actions: list) -> list:
    return [a for a in actions if not isinstance(a, SetTimer)]


def active_source(version: RMVersion = V11, sent: int = 0, **config: object) -> SourceSequence:
    source = SourceSequence(SourceRecord("k", version, retransmit_interval=1.0, max_interval=8.0, **config))
    source.handle(CreateRequested(0.0))
    source.handle(CreateSequenceResponded(CreateSequenceResponse(ID), 0.0))
    for _ in range(sent):
        source.handle(SendRequested(0.0))
    return source


def ack(*pairs: tuple[int, int], final: bool = False, nacks: tuple[int, ...] = ()) -> AckReceived:
    if nacks:
        return AckReceived(SequenceAcknowledgement(ID, nacks=nacks), 0.5)
    if not pairs:
        return AckReceived(SequenceAcknowledgement(ID, none=True, final=final), 0.5)
    return AckReceived(SequenceAcknowledgement(ID, ranges=pairs, final=final), 0.5)


def active_destination(version: RMVersion = V11, **config: object) -> DestinationSequence:
    destination = DestinationSequence(DestinationRecord(ID, version, inactivity_timeout=100.0, **config))
    destination.handle(CreateSequenceReceived(0.0))
    return destination


# ------------------------------------------------------------------------------------ tables, errors


def test_an_event_outside_the_table_raises_and_fails_the_machine_for_good() -> None:
    source = SourceSequence(SourceRecord("k", V11))
    with pytest.raises(ProtocolError, match="in state NEW: SendRequested is not allowed"):
        source.handle(SendRequested(0.0))
    assert source.state is SourceState.FAILED
    assert isinstance(ProtocolError("m", "s", "e", "w"), QtpError)
    with pytest.raises(ProtocolError, match="in state FAILED: CreateRequested .*failed earlier: SendRequested in NEW"):
        source.handle(CreateRequested(0.0))
    assert source.record.failure is not None and "SendRequested in NEW" in source.record.failure


def test_version_specific_events_are_table_errors() -> None:
    source = active_source(V10)
    with pytest.raises(ProtocolError, match="CloseRequested"):
        source.handle(CloseRequested(1.0))
    destination = active_destination(V10)
    with pytest.raises(ProtocolError, match="CloseReceived"):
        destination.handle(CloseReceived(1.0))
    assert destination.state is DestinationState.FAILED


def test_every_table_event_has_a_handler_and_failed_allows_nothing() -> None:
    machines = {"source": SourceSequence, "destination": DestinationSequence, "invoker": InvokerBuffer}
    for name, table in ALL_TABLES.items():
        machine = machines[name.split("-")[0]]
        states = {state for state in table}
        assert {s.value for s in states} <= {s.value for s in type(next(iter(states)))}
        for state, events in table.items():
            for event, targets in events.items():
                assert hasattr(machine, "on_" + event), (name, event)
                assert targets and targets <= states, (name, state, event)
        assert table[type(next(iter(states)))["FAILED"]] == {}


def test_state_diagrams_in_docs_are_generated_from_the_current_tables() -> None:
    rendered = render_all()
    committed = {path.name: path.read_text(encoding="utf-8") for path in DOCS.glob("wsrm-*.md")}
    assert committed == rendered, "docs/wsrm is stale: run `python -m qtp.wsrm.protocol.diagrams docs/wsrm`"
    assert "CLOSING --> TERMINATING: CloseResponded" in rendered["wsrm-source-1.1.md"]


# --------------------------------------------------------------------------------------- RM Source


def test_create_then_send_numbers_from_one_and_transmits() -> None:
    source = SourceSequence(SourceRecord("k", V11, retransmit_interval=1.0))
    first = source.handle(CreateRequested(0.0, offer_identifier="urn:offer"))
    assert first[0].offer_identifier == "urn:offer" and SetTimer(1.0) in first
    queued = source.handle(SendRequested(0.1))
    assert queued == [MessageNumbered(1)]  # numbered while CREATING, sent once the sequence exists
    response = CreateSequenceResponse(ID, accept_acks_to="http://client/acks")
    actions = source.handle(CreateSequenceResponded(response, 0.2))
    assert OfferAccepted("urn:offer") in actions
    assert of(Transmit, actions) == [Transmit(ID, 1, False, False, 1)]
    assert of(Transmit, source.handle(SendRequested(0.3))) == [Transmit(ID, 2, False, False, 1)]
    assert source.handle(CreateSequenceResponded(CreateSequenceResponse("urn:other"), 0.4)) == []
    assert source.record.identifier == ID


def test_create_sequence_is_retransmitted_until_answered() -> None:
    source = SourceSequence(SourceRecord("k", V11, retransmit_interval=1.0))
    source.handle(CreateRequested(0.0))
    assert source.handle(TimerFired(0.5)) == []
    assert len(source.handle(TimerFired(1.0))) == 2  # SendCreateSequence and the next SetTimer


def test_retransmission_backs_off_exponentially_up_to_the_cap() -> None:
    source = active_source(sent=1)
    times, now = [], 0.0
    for _ in range(6):
        now = source.record.pending[0][2]
        actions = source.handle(TimerFired(now))
        assert of(Transmit, actions)[0].ack_requested
        times.append(now)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps == [2.0, 4.0, 8.0, 8.0, 8.0]
    assert source.record.pending[0][1] == 7


def test_acknowledgement_ranges_release_messages_once() -> None:
    source = active_source(sent=5)
    actions = source.handle(ack((1, 2), (4, 4)))
    assert of(MessagesAcknowledged, actions) == [MessagesAcknowledged(((1, 2), (4, 4)))]
    assert [n for n, _, _ in source.record.pending] == [3, 5]
    assert untimed(source.handle(ack((1, 5)))) == [MessagesAcknowledged(((3, 3), (5, 5)))]
    assert source.handle(ack((1, 5))) == []


def test_one_event_numbers_a_batch_of_messages() -> None:
    source = active_source(sent=2)
    actions = source.handle(SendRequested(1.0, count=3))
    assert of(MessageNumbered, actions) == [MessageNumbered(n, False) for n in (3, 4, 5)]
    assert [t.number for t in of(Transmit, actions)] == [3, 4, 5]
    assert [n for n, _, _ in source.record.pending] == [1, 2, 3, 4, 5] and source.record.next_number == 6


def test_a_gap_below_an_acknowledged_number_is_sent_again_at_once_and_only_once() -> None:
    source = active_source(sent=5)
    actions = source.handle(ack((1, 2), (4, 4)))
    assert of(Transmit, actions) == [Transmit(ID, 3, False, False, 2)]  # 5 is above the gap: not shown lost
    assert of(Transmit, source.handle(ack((1, 2), (4, 5)))) == []  # the same gap again: its timer decides


def test_none_acknowledgement_changes_nothing_and_nack_resends_at_once() -> None:
    source = active_source(sent=3)
    assert source.handle(ack()) == []
    actions = source.handle(ack(nacks=(2,)))
    assert of(Transmit, actions) == [Transmit(ID, 2, False, False, 2)]


def test_acknowledging_an_unsent_number_is_invalid_acknowledgement() -> None:
    source = active_source(sent=2)
    actions = source.handle(ack((1, 3)))
    faults = of(SendFault, actions)
    assert faults[0].fault.code is FaultCode.INVALID_ACKNOWLEDGEMENT
    assert of(MessagesLost, actions) == [MessagesLost(((1, 2),))]
    assert source.state is SourceState.FAILED
    with pytest.raises(ProtocolError):
        source.handle(SendRequested(1.0))


def test_final_acknowledgement_in_active_loses_the_rest_and_terminates() -> None:
    source = active_source(sent=3)
    actions = source.handle(ack((1, 1), final=True))
    assert MessagesLost(((2, 3),)) in actions
    assert SendTerminateSequence(ID, 3) in actions
    assert source.state is SourceState.TERMINATING
    assert source.handle(TerminateResponded(1.0))[0] == SequenceEnded("terminated")


def test_ws_rm_11_completion_close_then_terminate() -> None:
    source = active_source(sent=2)
    assert source.handle(CompleteRequested(1.0)) == []
    assert source.state is SourceState.DRAINING
    actions = source.handle(ack((1, 2)))
    assert SendCloseSequence(ID, 2) in actions and source.state is SourceState.CLOSING
    assert of(SendCloseSequence, source.handle(TimerFired(5.0))) == [SendCloseSequence(ID, 2)]
    assert SendTerminateSequence(ID, 2) in source.handle(CloseResponded(5.0))
    assert source.handle(CloseResponded(5.1)) == []
    assert source.handle(TerminateResponded(6.0))[0] == SequenceEnded("terminated")
    assert source.state is SourceState.TERMINATED
    assert source.handle(ack((1, 2))) == [] and source.handle(TerminateResponded(7.0)) == []


def test_ws_rm_11_early_close_waits_for_the_final_ack_and_reports_losses() -> None:
    source = active_source(sent=3)
    source.handle(ack((1, 1)))
    assert SendCloseSequence(ID, 3) in source.handle(CloseRequested(1.0))
    assert SendAckRequested(ID) in source.handle(CloseResponded(1.5))
    assert source.state is SourceState.CLOSED
    actions = source.handle(ack((1, 2), final=True))
    assert MessagesLost(((3, 3),)) in actions and source.state is SourceState.TERMINATING


def test_ws_rm_10_completion_last_message_then_terminate_without_response() -> None:
    source = active_source(V10, sent=2)
    actions = source.handle(CompleteRequested(1.0))
    assert actions[:2] == [MessageNumbered(3, last_message=True), Transmit(ID, 3, True, False, 1)]
    actions = source.handle(ack((1, 3)))
    assert SendTerminateSequence(ID, None) in actions and SequenceEnded("completed") in actions
    assert source.state is SourceState.TERMINATED


def test_message_number_rollover_refuses_the_send() -> None:
    source = active_source(sent=2, max_message_number=2)
    assert source.handle(SendRequested(1.0)) == [SendRefused(FaultCode.MESSAGE_NUMBER_ROLLOVER)]
    assert source.record.next_number == 3
    actions = source.handle(FaultReceived(FaultCode.MESSAGE_NUMBER_ROLLOVER, 1.0))
    assert SendAckRequested(ID) in actions and source.state is SourceState.CLOSED


def test_sequence_expires() -> None:
    source = SourceSequence(SourceRecord("k", V11))
    source.handle(CreateRequested(0.0))
    source.handle(CreateSequenceResponded(CreateSequenceResponse(ID, expires=10.0), 0.0))
    source.handle(SendRequested(1.0))
    actions = source.handle(TimerFired(10.0))
    assert MessagesLost(((1, 1),)) in actions and SequenceEnded("expired") in actions
    assert source.state is SourceState.TERMINATED and source.record.end_reason == "expired"


@pytest.mark.parametrize("code", [FaultCode.CREATE_SEQUENCE_REFUSED, FaultCode.WSRM_REQUIRED])
def test_refused_create_fails_the_sequence(code: FaultCode) -> None:
    source = SourceSequence(SourceRecord("k", V11))
    source.handle(CreateRequested(0.0))
    source.handle(SendRequested(0.0))
    actions = source.handle(FaultReceived(code, 1.0))
    assert SequenceEnded(f"peer sent {code.value}", code) in actions
    assert MessagesLost(((1, 1),)) in actions and source.state is SourceState.FAILED


@pytest.mark.parametrize("code", [FaultCode.UNKNOWN_SEQUENCE, FaultCode.SEQUENCE_TERMINATED])
def test_terminating_source_accepts_that_the_destination_forgot(code: FaultCode) -> None:
    source = active_source(sent=1)
    source.handle(ack((1, 1), final=True))
    assert source.state is SourceState.TERMINATING
    source.handle(FaultReceived(code, 2.0))
    assert source.state is SourceState.TERMINATED


def test_unknown_sequence_fails_an_active_source() -> None:
    source = active_source(V10, sent=1)
    actions = source.handle(FaultReceived(FaultCode.UNKNOWN_SEQUENCE, 1.0))
    assert source.state is SourceState.FAILED and MessagesLost(((1, 1),)) in actions


# ---------------------------------------------------------------------------------- RM Destination


def test_destination_accepts_once_and_acknowledges_merged_ranges() -> None:
    destination = active_destination()
    for number in (1, 3, 2, 5):
        assert of(AcceptMessage, destination.handle(MessageReceived(number, 1.0))) == [AcceptMessage(number)]
    again = destination.handle(MessageReceived(2, 1.0))
    assert of(AcceptMessage, again) == []
    assert of(SendAcknowledgement, again)[0].ack.ranges == ((1, 3), (5, 5))


def test_destination_answers_create_sequence_retransmissions_with_the_same_response() -> None:
    destination = DestinationSequence(DestinationRecord(ID, V11))
    first = destination.handle(CreateSequenceReceived(0.0, expires=60.0, accepted_offer="urn:offer"))
    assert first[0] == SendCreateSequenceResponse(ID, 60.0, "urn:offer")
    assert destination.handle(CreateSequenceReceived(5.0)) == [first[0]]


def test_ack_none_in_ws_rm_11_and_silence_in_ws_rm_10() -> None:
    assert of(SendAcknowledgement, active_destination().handle(AckRequestedReceived(1.0)))[0].ack.none
    assert untimed(active_destination(V10).handle(AckRequestedReceived(1.0))) == []


def test_close_gives_final_ack_then_sequence_closed_for_new_numbers() -> None:
    destination = active_destination()
    destination.handle(MessageReceived(1, 1.0))
    actions = destination.handle(CloseReceived(2.0, 2))
    assert of(SendAcknowledgement, actions)[0].ack.final and SendCloseSequenceResponse(ID) in actions
    assert of(SendFault, destination.handle(MessageReceived(2, 3.0)))[0].fault.code is FaultCode.SEQUENCE_CLOSED
    assert of(SendAcknowledgement, destination.handle(MessageReceived(1, 3.0)))[0].ack.final
    assert SendCloseSequenceResponse(ID) in destination.handle(CloseReceived(3.0, 2))


@pytest.mark.parametrize("version", list(RMVersion))
def test_terminate_then_sequence_terminated(version: RMVersion) -> None:
    destination = active_destination(version)
    destination.handle(MessageReceived(1, 1.0))
    actions = destination.handle(TerminateReceived(2.0))
    assert (SendTerminateSequenceResponse(ID) in actions) is (version is V11)
    assert SequenceEnded("terminated") in actions
    fault = of(SendFault, destination.handle(MessageReceived(2, 3.0)))[0].fault
    assert fault.code is FaultCode.SEQUENCE_TERMINATED and fault.identifier == ID


def test_last_message_number_exceeded() -> None:
    destination = active_destination(V10)
    destination.handle(MessageReceived(3, 1.0, last_message=True))
    assert destination.record.last_number == 3
    fault = of(SendFault, destination.handle(MessageReceived(4, 1.0)))[0].fault
    assert fault.code is FaultCode.LAST_MESSAGE_NUMBER_EXCEEDED
    other = active_destination(V10)
    other.handle(MessageReceived(5, 1.0))
    code = of(SendFault, other.handle(MessageReceived(3, 1.0, last_message=True)))[0].fault.code
    assert code is FaultCode.LAST_MESSAGE_NUMBER_EXCEEDED


def test_destination_rollover_fault() -> None:
    destination = active_destination(max_message_number=2)
    fault = of(SendFault, destination.handle(MessageReceived(3, 1.0)))[0].fault
    assert fault.code is FaultCode.MESSAGE_NUMBER_ROLLOVER
    assert destination.record.received == ()


def test_inactivity_timeout_and_expiry_end_the_destination() -> None:
    destination = active_destination()
    destination.handle(MessageReceived(1, 50.0))
    assert destination.handle(TimerFired(149.0)) == []
    assert destination.handle(TimerFired(150.0))[0] == SequenceEnded("InactivityTimeout")
    assert destination.state is DestinationState.TERMINATED
    expiring = DestinationSequence(DestinationRecord(ID, V11))
    assert SetTimer(30.0) in expiring.handle(CreateSequenceReceived(0.0, expires=30.0))
    assert expiring.handle(TimerFired(30.0))[0] == SequenceEnded("expired")


def test_fault_from_the_source_fails_the_destination() -> None:
    destination = active_destination()
    actions = destination.handle(FaultReceived(FaultCode.INVALID_ACKNOWLEDGEMENT, 1.0))
    assert actions[0].code is FaultCode.INVALID_ACKNOWLEDGEMENT and destination.state is DestinationState.FAILED


def test_unknown_sequence_answer() -> None:
    fault = unknown_sequence("urn:nope").fault
    assert fault.code is FaultCode.UNKNOWN_SEQUENCE and fault.identifier == "urn:nope"


# ------------------------------------------------------------------------------------------ invoker


def test_in_order_invoker_waits_for_the_gap() -> None:
    invoker = InvokerBuffer(InvokerRecord(ID, in_order=True))
    assert invoker.handle(MessageStored(2)) == []
    assert invoker.handle(MessageStored(1)) == [Deliver(ID, 1)]
    assert invoker.handle(MessageStored(1)) == []  # stored twice, delivered once
    assert invoker.handle(DeliveryAborted(1)) == [Deliver(ID, 1)]
    assert invoker.handle(DeliveryCommitted(1)) == [Deliver(ID, 2)]
    invoker.handle(DeliveryCommitted(2))
    assert invoker.handle(SequenceCompleted(((1, 2),))) == [DeliveryFinished(ID)]
    assert invoker.state is InvokerState.COMPLETE


def test_unordered_invoker_delivers_at_once_and_in_order_skips_final_gaps() -> None:
    unordered = InvokerBuffer(InvokerRecord(ID, in_order=False))
    assert unordered.handle(MessageStored(3)) == [Deliver(ID, 3)]
    in_order = InvokerBuffer(InvokerRecord(ID, in_order=True))
    in_order.handle(MessageStored(3))
    assert in_order.handle(SequenceCompleted(((1, 1), (3, 3)))) == []
    assert in_order.state is InvokerState.DRAINING
    assert in_order.handle(MessageStored(1)) == [Deliver(ID, 1)]
    assert in_order.handle(DeliveryCommitted(1)) == [Deliver(ID, 3)]


def test_invoker_rejects_commit_of_a_message_never_handed_over() -> None:
    invoker = InvokerBuffer(InvokerRecord(ID, in_order=False))
    with pytest.raises(ProtocolError, match="not handed to the application"):
        invoker.handle(DeliveryCommitted(1))
    assert invoker.state is InvokerState.FAILED


# ---------------------------------------------------------------------------------- persistence


def test_records_round_trip_through_json_rows_mid_sequence() -> None:
    source = active_source(sent=3)
    source.handle(ack((2, 2)))
    destination = active_destination()
    destination.handle(MessageReceived(2, 1.0))
    invoker = InvokerBuffer(InvokerRecord(ID, in_order=True))
    invoker.handle(MessageStored(2))
    for machine in (source, destination, invoker):
        row = json.loads(json.dumps(to_row(machine.record)))
        record = from_row(type(machine.record), row)
        assert record == machine.record
        reloaded = type(machine)(record)
        assert reloaded.state is machine.state
    assert of(Transmit, SourceSequence(source.record).handle(TimerFired(100.0)))[0].number == 1


# ---------------------------------------------------------------------------------------- ranges


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 60), max_size=40), st.lists(st.integers(1, 60), max_size=40))
def test_ranges_behave_like_sets(left: list[int], right: list[int]) -> None:
    a, b = ranges.from_numbers(left), ranges.from_numbers(right)
    assert ranges.numbers(a) == sorted(set(left))
    assert ranges.numbers(ranges.union(a, b)) == sorted(set(left) | set(right))
    assert ranges.numbers(ranges.difference(a, b)) == sorted(set(left) - set(right))
    assert all(lo2 > hi1 + 1 for (_, hi1), (lo2, _) in zip(a, a[1:]))
    assert ranges.count(a) == len(set(left))
    expected = 0
    while expected + 1 in set(left):
        expected += 1
    assert ranges.contiguous_from_one(a) == expected


# ------------------------------------------------------------------------------------ no I/O, no qtp


def test_protocol_core_imports_no_io_and_nothing_of_qtp_but_errors() -> None:
    import ast

    package = Path(__file__).resolve().parent.parent / "qtp" / "wsrm" / "protocol"
    forbidden = {"socket", "time", "datetime", "threading", "asyncio", "random", "uuid", "sqlite3", "sqlalchemy",
                 "requests", "lxml", "subprocess", "select", "selectors", "http", "urllib"}
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in forbidden, (path.name, name)
                if name.startswith("qtp"):
                    assert name == "qtp.errors" or name.startswith("qtp.wsrm.protocol"), (path.name, name)
