"""
The etcd client and session against a real etcd on loopback (opt-in:
C{tox -e etcd}).
"""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.trial.unittest import TestCase

from nvproxy.etcd import Compacted, EtcdClient, EtcdUnavailable, WatchBatch, etcd_tls
from nvproxy.etcd._session import Session, SessionSettings
from nvproxy.proxy.upstream import Upstream
from nvproxy.testing.harness import eventually, free_port
from tests.integration.etcd import Etcd, make_tls, skip_reason

reactor: Any = _reactor


class _RealEtcdCase(TestCase):
    timeout = 60

    def setUp(self) -> Deferred[None]:
        reason = skip_reason()
        if reason is not None:
            self.skipTest(reason)
        self.etcd = Etcd(reactor, os.path.join(self.mktemp(), "etcd"))
        self.addCleanup(self.etcd.stop)
        self.upstream = Upstream(reactor, 2.0)
        self.addCleanup(self.upstream.close)
        return self.etcd.start()

    def client(self, *endpoints: str) -> EtcdClient:
        return EtcdClient(
            self.upstream.treq, reactor, endpoints or (self.etcd.url,), timeout=2.0
        )


class ClientTests(_RealEtcdCase):
    def test_lease_put_range_watch(self) -> Deferred[None]:
        async def run() -> None:
            client = self.client()
            lease = await client.grant(5)
            self.assertGreater(lease, 0)
            first = await client.put(b"/t/nodes/a", b"1", lease)
            await client.put(b"/t/other", b"x", 0)
            got = await client.range_prefix(b"/t/nodes/")
            self.assertEqual(
                [(kv.key, kv.value) for kv in got.kvs], [(b"/t/nodes/a", b"1")]
            )
            self.assertGreaterEqual(got.revision, first)
            batches: list[WatchBatch] = []
            watch = client.watch(b"/t/nodes/", got.revision + 1, batches.append)
            await client.put(b"/t/nodes/b", b"2", lease)
            self.assertGreater(await client.keepalive(lease), 0)
            await client.revoke(lease)
            await eventually(
                reactor,
                lambda: sum(len(b.events) for b in batches) >= 3,
                what="the watch to see put, then two deletes",
            )
            events = [(e.key, e.value) for b in batches for e in b.events]
            self.assertEqual(events[0], (b"/t/nodes/b", b"2"))
            self.assertEqual(
                sorted(events[1:]), [(b"/t/nodes/a", None), (b"/t/nodes/b", None)]
            )
            self.assertEqual(await client.keepalive(lease), 0, "revoked lease")
            watch.cancel()
            self.failureResultOf(watch.done)

        return ensureDeferred(run())

    def test_compacted_watch(self) -> Deferred[None]:
        async def run() -> None:
            client = self.client()
            for i in range(3):
                await client.put(b"/t/nodes/a", str(i).encode(), 0)
            got = await client.range_prefix(b"/t/")
            await client._call("/v3/kv/compaction", {"revision": str(got.revision)})
            watch = client.watch(b"/t/nodes/", 2, lambda batch: None)
            with self.assertRaises(Compacted):
                await watch.done

        return ensureDeferred(run())

    def test_endpoints_tried_in_turn(self) -> Deferred[None]:
        async def run() -> None:
            dead = f"http://127.0.0.1:{free_port()}"
            client = self.client(dead, self.etcd.url)
            await client.put(b"/t/x", b"1", 0)
            self.assertEqual(client.endpoint, self.etcd.url)

        return ensureDeferred(run())


class SessionTests(_RealEtcdCase):
    settings = SessionSettings(
        prefix="/nv/", lease_ttl=3.0, backoff=0.1, backoff_max=0.5
    )

    def session(self, name: str, seen: dict[str, dict[str, bytes]]) -> Session:
        def record() -> bytes:
            return json.dumps({"node": name}).encode()

        session = Session(
            self.client(),
            reactor,
            self.settings,
            name,
            record,
            lambda records: seen.__setitem__(name, dict(records)),
        )
        session.start()
        return session

    def test_killed_node_leaves_and_restart_resyncs(self) -> Deferred[None]:
        async def run() -> None:
            seen: dict[str, dict[str, bytes]] = {}
            a = self.session("a", seen)
            self.addCleanup(a.stop)
            b = self.session("b", seen)
            await eventually(
                reactor,
                lambda: set(seen.get("a", ())) == {"a", "b"},
                attempts=300,
                what="a to see b",
            )
            # b dies without revoking: its record leaves with its lease
            b._machine.stop()
            started = reactor.seconds()
            await eventually(
                reactor,
                lambda: set(seen["a"]) == {"a"},
                attempts=600,
                what="b's lease to expire",
            )
            self.assertLess(reactor.seconds() - started, self.settings.lease_ttl + 2)
            # etcd restarts: a keeps its snapshot, then resyncs
            await self.etcd.stop()
            await eventually(reactor, lambda: a.state == "lost", attempts=300)
            self.assertEqual(set(a.records), {"a"})
            await self.etcd.start()
            c = self.session("c", seen)
            self.addCleanup(c.stop)
            await eventually(
                reactor,
                lambda: a.state == "live" and set(a.records) == {"a", "c"},
                attempts=600,
                what="a to resync and see c",
            )

        return ensureDeferred(run())


class TlsTests(TestCase):
    """etcd over https with a client certificate, on the shared pool."""

    timeout = 60

    def test_client_certificate(self) -> Deferred[None]:
        reason = skip_reason()
        if reason is not None:
            self.skipTest(reason)
        base = self.mktemp()
        tls = make_tls(os.path.join(base, "tls"))
        etcd = Etcd(
            reactor,
            os.path.join(base, "etcd"),
            tls=(tls["server"], tls["server_key"], tls["ca"]),
        )

        async def run() -> None:
            await etcd.start()
            self.addCleanup(etcd.stop)
            with_cert = Upstream(
                reactor,
                2.0,
                tls_for=etcd_tls(
                    (etcd.url,), tls["client"], tls["client_key"], tls["ca"]
                ),
            )
            self.addCleanup(with_cert.close)
            client = EtcdClient(with_cert.treq, reactor, [etcd.url], timeout=2.0)
            await client.put(b"/t/x", b"1", 0)
            got = await client.range_prefix(b"/t/")
            self.assertEqual([kv.value for kv in got.kvs], [b"1"])
            without = Upstream(
                reactor,
                2.0,
                tls_for=etcd_tls((etcd.url,), None, None, tls["ca"]),
            )
            self.addCleanup(without.close)
            refused = EtcdClient(without.treq, reactor, [etcd.url], timeout=2.0)
            with self.assertRaises(EtcdUnavailable):
                await refused.put(b"/t/x", b"2", 0)

        return ensureDeferred(run())
