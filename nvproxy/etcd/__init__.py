# -*- test-case-name: tests.test_etcd -*-
"""
Discovery through etcd: each node keeps its node record under a lease at
C{PREFIX/nodes/<node-id>} and watches the prefix for everyone else's.
"""

from nvproxy.etcd._client import (
    Compacted,
    EtcdApi,
    EtcdClient,
    EtcdRefused,
    EtcdUnavailable,
    KeyValue,
    Range,
    Watch,
    WatchBatch,
    WatchEvent,
    prefix_end,
)

__all__ = [
    "Compacted",
    "EtcdApi",
    "EtcdClient",
    "EtcdRefused",
    "EtcdUnavailable",
    "KeyValue",
    "Range",
    "Watch",
    "WatchBatch",
    "WatchEvent",
    "prefix_end",
]
