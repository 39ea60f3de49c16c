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
from nvproxy.etcd._fleet import EtcdPeers, etcd_document
from nvproxy.etcd._provider import EtcdDiscovery, Records, encode_record, etcd_tls
from nvproxy.etcd._session import Session, SessionSettings

__all__ = [
    "Compacted",
    "EtcdApi",
    "EtcdClient",
    "EtcdDiscovery",
    "EtcdPeers",
    "EtcdRefused",
    "EtcdUnavailable",
    "KeyValue",
    "Range",
    "Records",
    "Session",
    "SessionSettings",
    "Watch",
    "WatchBatch",
    "WatchEvent",
    "encode_record",
    "etcd_document",
    "etcd_tls",
    "prefix_end",
]
