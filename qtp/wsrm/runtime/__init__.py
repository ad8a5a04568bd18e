"""The queue runtime: ``tx.send()``, the sender, the WSGI endpoint, the invoker; see ``Node``.

The protocol machines (``qtp.wsrm.protocol``) decide; this package carries out their actions with the
stores (``qtp.wsrm.store``), HTTP (``requests`` out, WSGI in) and the transaction manager.
"""

from qtp.coordinator import register_attachment
from qtp.wsrm.runtime._endpoint import Endpoint
from qtp.wsrm.runtime._invoker import Message
from qtp.wsrm.runtime._node import _SHARING, Node, attach_from_config
from qtp.wsrm.runtime._shared import SharedNode
from qtp.wsrm.runtime._settings import MODES, ChannelSettings, Limits, NodeSettings, node_settings
from qtp.wsrm.runtime._transport import Transport, TransportError

register_attachment("messaging", attach_from_config)  # TransactionManager.from_config builds the node
_SHARING.append(SharedNode)  # Node.from_config builds a replica sharing the work for a file with [lease] slots

__all__ = ["MODES", "ChannelSettings", "Endpoint", "Limits", "Message", "Node", "NodeSettings", "SharedNode",
           "Transport", "TransportError", "node_settings"]
