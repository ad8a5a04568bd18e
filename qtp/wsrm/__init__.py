"""WS-ReliableMessaging for qtp.

- ``qtp.wsrm.protocol``: sans-I/O RM Source, RM Destination and invoker state machines.
- ``qtp.wsrm.codec``: SOAP 1.1/1.2 envelopes for WS-RM 1.0 and 1.1 with lxml (``encode`` / ``decode``).
"""
