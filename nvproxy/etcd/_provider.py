# -*- test-case-name: tests.test_etcd -*-
"""
The etcd discovery provider: this node's record kept in etcd by a
L{Session}, everyone's records decoded and handed on (coalesced, once per
reactor turn) to whoever builds discovery snapshots from them, metrics, and
the TLS a dial to etcd uses.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IOpenSSLClientConnectionCreator
from twisted.internet.ssl import Certificate, PrivateCertificate, optionsForClientTLS
from twisted.logger import Logger

from nvproxy.etcd._client import EtcdApi
from nvproxy.etcd._session import Session, SessionSettings

log = Logger()

Records = Mapping[str, Mapping[str, Any]]


def encode_record(record: Mapping[str, Any]) -> bytes:
    """A record as stored: compact JSON, keys sorted (equal records, equal
    bytes, so an unchanged record is never re-put)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


class _Metrics(Collector):
    def __init__(self, provider: EtcdDiscovery) -> None:
        self._provider = provider

    def collect(self) -> Any:
        age = GaugeMetricFamily(
            "nvproxy_discovery_snapshot_age_seconds",
            "Seconds since the discovery snapshot was last known current"
            " (0 while the etcd watch is live)",
        )
        value = self._provider.session.snapshot_age()
        age.add_metric([], -1.0 if value is None else value)
        yield age
        records = GaugeMetricFamily(
            "nvproxy_etcd_records", "Node records seen under the etcd prefix"
        )
        records.add_metric([], len(self._provider.session.records))
        yield records


class _Counters:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self._connects = Counter(
            "nvproxy_etcd_watch_connects",
            "etcd watches opened (the first and every reconnect)",
            registry=registry,
        )
        self._keepalive_failures = Counter(
            "nvproxy_etcd_keepalive_failures",
            "etcd lease keep-alives that failed or found the lease expired",
            registry=registry,
        )

    def watch_connected(self) -> None:
        self._connects.inc()

    def keepalive_failed(self) -> None:
        self._keepalive_failures.inc()


class EtcdDiscovery(Service):
    """
    @param record: this node's current record (a JSON document).
    @param subscribe: C{subscribe(changed)} calls C{changed()} whenever the
        record changes; returns an unsubscribe callable.
    @param apply: given every other node's decoded record, by node id, after
        each change (a later change in the same reactor turn replaces an
        earlier one).
    """

    def __init__(
        self,
        api: EtcdApi,
        clock: Any,
        settings: SessionSettings,
        node_id: str,
        record: Callable[[], Mapping[str, Any]],
        subscribe: Callable[[Callable[[], None]], Callable[[], None]],
        apply: Callable[[Records], None],
        registry: CollectorRegistry | None = None,
        random: Callable[[], float] = lambda: 0.5,
        endpoint: Callable[[], str] = lambda: "",
    ) -> None:
        super().__init__()
        self._clock = clock
        self._node_id = node_id
        self._record = record
        self._subscribe = subscribe
        self._unsubscribe: Callable[[], None] | None = None
        self._apply = apply
        self._endpoint = endpoint
        self._decoded: dict[str, tuple[bytes, Mapping[str, Any] | None]] = {}
        self._pending: IDelayedCall | None = None
        self.session = Session(
            api,
            clock,
            settings,
            node_id,
            lambda: encode_record(self._record()),
            self._delivered,
            _Counters(registry),
            random,
        )
        if registry is not None:
            registry.register(_Metrics(self))

    @property
    def records(self) -> Records:
        """Every other node's record that decodes, by node id."""
        return {
            node: record
            for node, (_, record) in self._decoded.items()
            if record is not None and node != self._node_id
        }

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._unsubscribe = self._subscribe(self.session.record_changed)
        self.session.start()

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        self._pending = None
        return self.session.stop()

    def status(self) -> dict[str, Any]:
        status = self.session.status()
        status["endpoint"] = self._endpoint()
        return status

    def _delivered(self, raw: Mapping[str, bytes]) -> None:
        for node in [n for n in self._decoded if n not in raw]:
            del self._decoded[node]
        for node, value in raw.items():
            known = self._decoded.get(node)
            if known is not None and known[0] == value:
                continue
            self._decoded[node] = (value, self._decode(node, value, known))
        if self._pending is None or not self._pending.active():
            self._pending = self._clock.callLater(0, self._hand_on)

    def _decode(
        self,
        node: str,
        value: bytes,
        known: tuple[bytes, Mapping[str, Any] | None] | None,
    ) -> Mapping[str, Any] | None:
        try:
            record = json.loads(value)
        except ValueError:
            record = None
        if isinstance(record, dict):
            return record
        # one line per node per change into the bad state, never per event
        if known is None or known[1] is not None:
            log.warn(
                "etcd: record of node {node} is not a JSON object; ignored",
                node=node,
            )
        return None

    def _hand_on(self) -> None:
        self._pending = None
        self._apply(self.records)


def etcd_tls(
    endpoints: tuple[str, ...],
    cert: str | None,
    key: str | None,
    ca: str | None,
) -> Callable[[str, int], IOpenSSLClientConnectionCreator | None]:
    """
    The client TLS for dialing etcd's https endpoints: etcd's CA (else the
    system roots) and, if given, a client certificate; C{None} for any
    other host and port.
    """
    from urllib.parse import urlsplit

    targets: set[tuple[str, int]] = set()
    for url in endpoints:
        parts = urlsplit(url)
        if parts.scheme == "https" and parts.hostname:
            targets.add((parts.hostname, parts.port or 443))
    if not targets:
        return lambda host, port: None
    root = None
    if ca is not None:
        with open(ca, "rb") as f:
            root = Certificate.loadPEM(f.read())
    client = None
    if cert is not None and key is not None:
        with open(cert, "rb") as f:
            cert_pem = f.read()
        with open(key, "rb") as f:
            key_pem = f.read()
        client = PrivateCertificate.loadPEM(cert_pem + b"\n" + key_pem)
    creators = {
        (host, port): optionsForClientTLS(
            host, trustRoot=root, clientCertificate=client
        )
        for host, port in targets
    }

    def tls_for(host: str, port: int) -> IOpenSSLClientConnectionCreator | None:
        return creators.get((host.strip("[]"), port))

    return tls_for
