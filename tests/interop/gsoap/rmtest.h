/* qtp interop test service: one one-way operation, carried reliably by WS-RM.
   This file is imported by rmtest11.h (WS-RM 1.1) and rmtest10.h (WS-RM 1.0); soapcpp2 reads it. */

//gsoap ns service name:      rmtest
//gsoap ns service namespace: urn:qtp:interop:gsoap
//gsoap ns schema  namespace: urn:qtp:interop:gsoap
//gsoap ns service style:     document
//gsoap ns service encoding:  literal

//gsoap ns service method-header-part: deliver wsa5__MessageID
//gsoap ns service method-header-part: deliver wsa5__RelatesTo
//gsoap ns service method-header-part: deliver wsa5__From
//gsoap ns service method-header-part: deliver wsa5__ReplyTo
//gsoap ns service method-header-part: deliver wsa5__FaultTo
//gsoap ns service method-header-part: deliver wsa5__To
//gsoap ns service method-header-part: deliver wsa5__Action
//gsoap ns service method-header-part: deliver wsrm__Sequence
//gsoap ns service method-header-part: deliver wsrm__AckRequested
//gsoap ns service method-header-part: deliver wsrm__SequenceAcknowledgement
//gsoap ns service method-action:      deliver urn:qtp:interop:gsoap/deliver

/* One-way: the body is <ns:deliver><text>...</text></ns:deliver>, no response message. */
int ns__deliver(char *text, void);
