"""Recovery: resolve this node's in-doubt branches from its decision log (presumed abort).

Used at manager start-up and in the background (``RecoveryService``), and from outside a manager by
``qtp recover`` / ``qtp status`` (``recover_node``, ``node_status``). See docs/recovery.md.
"""

from qtp.recovery._core import RecoveryReport, Row, run_pass
from qtp.recovery._node import (
    QUARANTINE_FILE,
    LiveManagerError,
    NodeStatus,
    log_present,
    node_status,
    read_quarantine,
    recover_node,
)
from qtp.recovery._service import RecoveryService
from qtp.coordinator._manager import set_default_recovery

set_default_recovery(lambda manager: RecoveryService(manager, manager.recovery_interval))

__all__ = [
    "QUARANTINE_FILE", "LiveManagerError", "NodeStatus", "RecoveryReport", "RecoveryService", "Row",
    "log_present", "node_status", "read_quarantine", "recover_node", "run_pass",
]
