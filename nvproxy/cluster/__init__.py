# -*- test-case-name: tests.test_cluster -*-
"""
The cluster: this node's identity, the peers it trusts, and mutual TLS between
them (DESIGN §3, spec §7).

  - L{nvproxy.cluster.pins}: the values — fingerprints, peers, this node's
    identity, the L{ClusterState} and its pins.
  - L{nvproxy.cluster.store}: the cluster dir on disk (its format is described
    there) and the L{ClusterWatcher} that re-derives the state when it changes.
  - L{nvproxy.cluster.tls}: the TLS contexts both ways, checked against the
    current pins.

The C{nvproxyctl cluster ...} commands that edit the dir live in
L{nvproxy.ctl.cluster}.
"""

from nvproxy.cluster.pins import (
    ENGINE_IDS,
    ClusterError,
    ClusterState,
    Fingerprint,
    Identity,
    Peer,
    validate_node_id,
)
from nvproxy.cluster.store import DEFAULT_CLUSTER_DIR, ClusterDir, ClusterWatcher
from nvproxy.cluster.tls import (
    ClientTLS,
    ClientTLSCache,
    PeerPolicyForHTTPS,
    PeerVerificationError,
    ServerTLS,
    peer_fingerprint,
)

__all__ = [
    "DEFAULT_CLUSTER_DIR",
    "ENGINE_IDS",
    "ClientTLS",
    "ClientTLSCache",
    "ClusterDir",
    "ClusterError",
    "ClusterState",
    "ClusterWatcher",
    "Fingerprint",
    "Identity",
    "Peer",
    "PeerPolicyForHTTPS",
    "PeerVerificationError",
    "ServerTLS",
    "peer_fingerprint",
    "validate_node_id",
]
