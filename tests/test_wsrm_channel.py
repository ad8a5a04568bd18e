"""An RM Source and an RM Destination over a channel that drops, duplicates, delays and reorders.

Hypothesis drives the application (send, complete), the network (deliver any queued message, drop it or
deliver a copy), the fake clock (timers fire on both machines), the application's transactions (commit or
abort a delivery) and crashes (every machine is rebuilt from its saved row). After every step: nothing
was delivered twice, in-order delivery is in order, and every acknowledgement names only numbers the
destination really received. At the end the channel becomes fair (no more drops, everything delivered in
the end) and then every message must reach the application exactly once and every machine must finish.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from qtp.wsrm.codec import COMBINATIONS, Addressing, Envelope, SoapVersion, decode, default_action, encode
from qtp.wsrm.protocol import (
    AcceptMessage,
    AckRequested,
    CloseSequence,
    CloseSequenceResponse,
    CreateSequence,
    SequenceFault,
    TerminateSequence,
    TerminateSequenceResponse,
    Sequence,
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
    FaultReceived,
    InvokerBuffer,
    InvokerRecord,
    InvokerState,
    MessageNumbered,
    MessageReceived,
    MessagesLost,
    MessageStored,
    RMVersion,
    SendAcknowledgement,
    SendAckRequested,
    SendCloseSequence,
    SendCloseSequenceResponse,
    SendCreateSequence,
    SendCreateSequenceResponse,
    SendFault,
    SendRequested,
    SendTerminateSequence,
    SendTerminateSequenceResponse,
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
)
from qtp.wsrm.protocol import _ranges as ranges

IDENTIFIER = "urn:uuid:4a1c7e3e-0000-4000-8000-000000000001"
INACTIVITY = 10_000.0
MAX_MESSAGES = 25


def reload(machine: Any, record_type: type) -> Any:
    """A crash: the machine is rebuilt from its database row (through JSON, as a store would keep it)."""
    row = json.loads(json.dumps(to_row(machine.record)))
    record = from_row(record_type, row)
    if record != machine.record:
        raise AssertionError(f"row round trip changed the record: {machine.record} -> {record}")
    return type(machine)(record)


class Wire:
    """Every message crosses the channel as SOAP bytes: encoded, decoded, and turned back into a message.

    This is the runtime's job in miniature; here it proves that whatever the machines ask to send, in
    either WS-RM version, the codec can express and read back.
    """

    def __init__(self, version: RMVersion, soap: SoapVersion, wsa_index: int):
        self.version, self.soap = version, soap
        choices = [wsa for rm, wsa in COMBINATIONS if rm is version]  # WS-RM 1.0 goes with either addressing
        self.wsa = choices[wsa_index % len(choices)]

    def cross(self, message: tuple[Any, ...]) -> tuple[Any, ...]:
        envelope = self._envelope(message)
        action = "urn:example:app/Order" if envelope.payload is not None else default_action(envelope)
        envelope = dataclasses.replace(envelope, addressing=Addressing(action=action, to="http://peer/rm"))
        received = decode(encode(envelope))
        assert received == envelope, (received, envelope)
        return self._message(received)

    def _envelope(self, message: tuple[Any, ...]) -> Envelope:
        kind, base = message[0], Envelope(self.soap, self.version, self.wsa)
        fields: dict[str, Any] = {}
        if kind == "create":
            fields["body"] = CreateSequence("http://client/acks")
        elif kind == "message":
            fields["sequence"] = Sequence(IDENTIFIER, message[1], message[2])
            if not message[2]:
                fields["payload"] = f'<o:order xmlns:o="urn:example:orders" n="{message[1]}"/>'.encode()
        elif kind == "ack-requested":
            fields["ack_requests"] = (AckRequested(IDENTIFIER),)
        elif kind == "close":
            fields["body"] = CloseSequence(IDENTIFIER, message[1])
        elif kind == "terminate":
            fields["body"] = TerminateSequence(IDENTIFIER, message[1])
        elif kind == "fault":
            fields["body"] = SequenceFault(message[1], IDENTIFIER, "from the channel test")
        elif kind == "created":
            fields["body"] = CreateSequenceResponse(message[1])
        elif kind == "ack":
            fields["acks"] = (message[1],)
        elif kind == "closed":
            fields["body"] = CloseSequenceResponse(IDENTIFIER)
        else:
            fields["body"] = TerminateSequenceResponse(IDENTIFIER)
        return dataclasses.replace(base, **fields)

    @staticmethod
    def _message(envelope: Envelope) -> tuple[Any, ...]:
        body = envelope.body
        simple = {CreateSequence: ("create",), CloseSequenceResponse: ("closed",),
                  TerminateSequenceResponse: ("terminated",)}
        if type(body) in simple:
            return simple[type(body)]
        if isinstance(body, CreateSequenceResponse):
            return ("created", body.identifier)
        if isinstance(body, CloseSequence):
            return ("close", body.last_msg_number)
        if isinstance(body, TerminateSequence):
            return ("terminate", body.last_msg_number)
        if isinstance(body, SequenceFault):
            return ("fault", body.code)
        if envelope.sequence is not None:
            return ("message", envelope.sequence.number, envelope.sequence.last_message)
        if envelope.acks:
            return ("ack", envelope.acks[0])
        return ("ack-requested",)


class LossyChannel(RuleBasedStateMachine):
    @initialize(version=st.sampled_from(list(RMVersion)), in_order=st.booleans(), handshake=st.booleans(),
                soap=st.sampled_from(list(SoapVersion)), wsa_index=st.integers(0, 1))
    def setup(self, version: RMVersion, in_order: bool, handshake: bool, soap: SoapVersion, wsa_index: int) -> None:
        self.wire = Wire(version, soap, wsa_index)
        self.version = version
        self.in_order = in_order
        self.now = 0.0
        self.fair = False
        self.completed = False
        self.closed_early = False
        self.source = SourceSequence(SourceRecord("client-1", version, retransmit_interval=1.0, max_interval=8.0))
        self.destination: DestinationSequence | None = None
        self.invoker = InvokerBuffer(InvokerRecord(IDENTIFIER, in_order))
        self.to_destination: list[tuple[Any, ...]] = []
        self.to_source: list[tuple[Any, ...]] = []
        self.app_numbers: list[int] = []  # numbered application messages, in send order
        self.last_marker: int | None = None  # WS-RM 1.0 LastMessage number (no payload)
        self.received: set[int] = set()  # numbers that reached the destination
        self.handed_over: list[int] = []  # Deliver actions not yet committed or aborted
        self.delivered: list[int] = []  # what the application committed, in order
        self.lost: list[Any] = []
        self.ended: list[tuple[str, SequenceEnded]] = []
        self._source(CreateRequested(self.now))
        if handshake:  # start with the sequence created, so that more runs send and close while ACTIVE
            self._at_destination(self.to_destination.pop())
            self._at_source(self.to_source.pop())

    # ------------------------------------------------------------------------------ action plumbing

    def _source(self, event: Any) -> None:
        for action in self.source.handle(event):
            self._source_action(action)

    def _source_action(self, action: Any) -> None:
        if isinstance(action, SendCreateSequence):
            self.to_destination.append(("create",))
        elif isinstance(action, MessageNumbered):
            if action.last_message:
                self.last_marker = action.number
            else:
                self.app_numbers.append(action.number)
        elif isinstance(action, Transmit):
            self.to_destination.append(("message", action.number, action.last_message))
            if action.ack_requested:
                self.to_destination.append(("ack-requested",))
        elif isinstance(action, SendAckRequested):
            self.to_destination.append(("ack-requested",))
        elif isinstance(action, SendCloseSequence):
            self.to_destination.append(("close", action.last_msg_number))
        elif isinstance(action, SendTerminateSequence):
            self.to_destination.append(("terminate", action.last_msg_number))
        elif isinstance(action, SendFault):
            self.to_destination.append(("fault", action.fault.code))
        elif isinstance(action, MessagesLost):
            self.lost.append(action)
        elif isinstance(action, SequenceEnded):
            self.ended.append(("source", action))

    def _destination(self, event: Any) -> None:
        assert self.destination is not None
        for action in self.destination.handle(event):
            self._destination_action(action)

    def _destination_action(self, action: Any) -> None:
        if isinstance(action, SendCreateSequenceResponse):
            self.to_source.append(("created", action.identifier))
        elif isinstance(action, AcceptMessage):
            self._invoker(MessageStored(action.number))
        elif isinstance(action, SendAcknowledgement):
            claimed = set(ranges.numbers(action.ack.ranges))
            assert claimed <= self.received, f"ack claims {sorted(claimed - self.received)} never received"
            self.to_source.append(("ack", action.ack))
        elif isinstance(action, SendCloseSequenceResponse):
            self.to_source.append(("closed",))
        elif isinstance(action, SendTerminateSequenceResponse):
            self.to_source.append(("terminated",))
        elif isinstance(action, SendFault):
            self.to_source.append(("fault", action.fault.code))
        elif isinstance(action, SequenceEnded):
            self.ended.append(("destination", action))
            assert self.destination is not None
            self._invoker(SequenceCompleted(self.destination.record.received))

    def _invoker(self, event: Any) -> None:
        for action in self.invoker.handle(event):
            if isinstance(action, Deliver):
                if action.number == self.last_marker:  # the empty LastMessage: nothing for the application
                    self._invoker(DeliveryCommitted(action.number))
                else:
                    self.handed_over.append(action.number)
            else:
                assert isinstance(action, (DeliveryFinished, SetTimer)), action

    def _at_destination(self, message: tuple[Any, ...]) -> None:
        message = self.wire.cross(message)
        kind = message[0]
        if kind == "create":
            if self.destination is None:
                self.destination = DestinationSequence(
                    DestinationRecord(IDENTIFIER, self.version, inactivity_timeout=INACTIVITY)
                )
            self._destination(CreateSequenceReceived(self.now))
            return
        assert self.destination is not None, "only CreateSequence can precede the destination"
        if kind == "message":
            self.received.add(message[1])
            self._destination(MessageReceived(message[1], self.now, last_message=message[2]))
        elif kind == "ack-requested":
            self._destination(AckRequestedReceived(self.now))
        elif kind == "close":
            self._destination(CloseReceived(self.now, message[1]))
        elif kind == "terminate":
            self._destination(TerminateReceived(self.now, message[1]))
        else:
            self._destination(FaultReceived(message[1], self.now))

    def _at_source(self, message: tuple[Any, ...]) -> None:
        message = self.wire.cross(message)
        kind = message[0]
        if kind == "created":
            self._source(CreateSequenceResponded(CreateSequenceResponse(message[1]), self.now))
        elif kind == "ack":
            self._source(AckReceived(message[1], self.now))
        elif kind == "closed":
            self._source(CloseResponded(self.now))
        elif kind == "terminated":
            self._source(TerminateResponded(self.now))
        else:
            self._source(FaultReceived(message[1], self.now))

    # ------------------------------------------------------------------------------------------ rules

    @precondition(lambda self: not self.completed and len(self.app_numbers) < MAX_MESSAGES)
    @rule()
    def send(self) -> None:
        self._source(SendRequested(self.now))

    @precondition(lambda self: not self.completed)
    @rule()
    def complete(self) -> None:
        self.completed = True
        self._source(CompleteRequested(self.now))

    @precondition(lambda self: not self.completed and self.source.state is SourceState.ACTIVE
                  and self.version is RMVersion.WSRM11)
    @rule()
    def close_now(self) -> None:
        """WS-RM 1.1 CloseSequence with messages maybe unacknowledged: what is not received is lost."""
        self.completed = self.closed_early = True
        self._source(CloseRequested(self.now))

    @precondition(lambda self: self.to_destination)
    @rule(pick=st.integers(0, 10_000), fate=st.sampled_from(["deliver", "deliver", "drop", "duplicate"]))
    def network_to_destination(self, pick: int, fate: str) -> None:
        self._network(self.to_destination, pick, fate, self._at_destination)

    @precondition(lambda self: self.to_source)
    @rule(pick=st.integers(0, 10_000), fate=st.sampled_from(["deliver", "deliver", "drop", "duplicate"]))
    def network_to_source(self, pick: int, fate: str) -> None:
        self._network(self.to_source, pick, fate, self._at_source)

    def _network(self, queue: list[tuple[Any, ...]], pick: int, fate: str, arrive: Any) -> None:
        index = pick % len(queue)  # any queued message, not only the oldest: delay and reordering
        message = queue[index] if fate == "duplicate" else queue.pop(index)
        if fate != "drop" or self.fair:
            arrive(message)

    @rule(seconds=st.floats(0.1, 20.0))
    def clock(self, seconds: float) -> None:
        self.now += seconds
        self._source(TimerFired(self.now))
        if self.destination is not None:
            self._destination(TimerFired(self.now))

    @precondition(lambda self: self.handed_over)
    @rule(pick=st.integers(0, 100), commit=st.sampled_from([True, True, False]))
    def application(self, pick: int, commit: bool) -> None:
        number = self.handed_over.pop(pick % len(self.handed_over))
        if commit:
            self.delivered.append(number)
            self._invoker(DeliveryCommitted(number))
        else:
            self._invoker(DeliveryAborted(number))

    @rule()
    def crash(self) -> None:
        self.source = reload(self.source, SourceRecord)
        self.invoker = reload(self.invoker, type(self.invoker.record))
        if self.destination is not None:
            self.destination = reload(self.destination, DestinationRecord)

    # ------------------------------------------------------------------------------------- invariants

    @invariant()
    def exactly_once_and_in_order(self) -> None:
        if not hasattr(self, "delivered"):
            return
        assert len(self.delivered) == len(set(self.delivered)), f"delivered twice: {self.delivered}"
        assert set(self.delivered) <= set(self.app_numbers)
        if self.in_order:
            assert self.delivered == sorted(self.delivered), self.delivered
            if not self.closed_early:
                assert self.delivered == list(range(1, len(self.delivered) + 1)), self.delivered

    @invariant()
    def destination_only_knows_sent_numbers(self) -> None:
        if getattr(self, "destination", None) is not None:
            assert set(ranges.numbers(self.destination.record.received)) <= self.received
            assert self.source.state is not SourceState.FAILED, self.source.record.failure

    def teardown(self) -> None:
        if not hasattr(self, "source"):
            return
        self.fair = True
        if not self.completed:
            self.complete()
        for _ in range(300):
            if self._finished():
                break
            self._fair_round()
        self._check_outcome()

    def _finished(self) -> bool:
        return (
            self.source.state is SourceState.TERMINATED
            and self.destination is not None
            and self.destination.state is DestinationState.TERMINATED
            and self.invoker.state is InvokerState.COMPLETE
            and not self.handed_over
        )

    def _fair_round(self) -> None:
        """Fair: everything queued arrives (oldest first), the application commits, time moves on."""
        while self.to_destination or self.to_source or self.handed_over:
            if self.to_destination:
                self._at_destination(self.to_destination.pop(0))
            if self.to_source:
                self._at_source(self.to_source.pop(0))
            if self.handed_over:
                self.application(0, True)
        step = 8.0 if self.source.state is not SourceState.TERMINATED else INACTIVITY
        self.clock(step)

    def _check_outcome(self) -> None:
        assert self._finished(), (
            f"not finished: source {self.source.state} dest {self.destination and self.destination.state} "
            f"invoker {self.invoker.state} failure {self.source.record.failure}"
        )
        lost = [n for action in self.lost for n in ranges.numbers(action.ranges)]
        if self.closed_early:  # every message is either delivered once or reported lost, never both
            assert sorted(self.delivered + lost) == self.app_numbers, (self.delivered, lost, self.app_numbers)
        else:
            assert not lost, lost
            assert sorted(self.delivered) == self.app_numbers, (self.delivered, self.app_numbers)
        if self.in_order:
            assert self.delivered == sorted(self.delivered)
        assert self.source.record.end_reason in ("completed", "terminated"), self.source.record.end_reason


LossyChannel.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestLossyChannel = LossyChannel.TestCase
