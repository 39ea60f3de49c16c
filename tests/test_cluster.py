# -*- test-case-name: tests.test_cluster -*-
"""
Tests for L{nvproxy.cluster}: the cluster dir, its watcher, the CLI
(L{nvproxy.ctl.cluster}), and mutual TLS through
L{nvproxy.proxy.listener.DemuxFactory} on real loopback sockets.
"""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import given, settings
from hypothesis import strategies as st
from OpenSSL import SSL
from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.interfaces import (
    IListeningPort,
    IOpenSSLClientConnectionCreator,
    ISSLTransport,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.protocols.policies import WrappingFactory
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    ResponseFailed,
    ResponseNeverReceived,
    readBody,
)
from twisted.web.iweb import IPolicyForHTTPS
from twisted.web.resource import Resource
from twisted.web.server import Request, Site
from zope.interface import implementer
from zope.interface.verify import verifyObject

from nvproxy.cluster import (
    ClientTLS,
    ClientTLSCache,
    ClusterDir,
    ClusterError,
    ClusterState,
    ClusterWatcher,
    Fingerprint,
    Identity,
    Peer,
    PeerPolicyForHTTPS,
    PeerVerificationError,
    ServerTLS,
    peer_fingerprint,
)
from nvproxy.ctl import main
from nvproxy.ctl.cluster import cluster_command
from nvproxy.engines import ENGINES as ENGINE_TABLE
from nvproxy.proxy.listener import DemuxFactory, tls_personality

reactor: Any = _reactor
NOW = 1_750_000_000.0
ENGINES = ["ollama", "lmstudio", "llamacpp", "vllm"]


def clock_at(seconds: float = NOW) -> Clock:
    clock = Clock()
    clock.advance(seconds)
    return clock


def make_dir(case: SynchronousTestCase, node_id: str | None = None) -> ClusterDir:
    directory = ClusterDir(case.mktemp())
    if node_id is not None:
        directory.init(node_id, clock_at())
    return directory


def fake_fingerprint(n: int) -> Fingerprint:
    return Fingerprint(bytes([n]) * 32)


class FingerprintTests(SynchronousTestCase):
    DIGEST = bytes(range(32))

    def test_formats(self) -> None:
        """Every accepted spelling parses to the same fingerprint."""
        hexed = self.DIGEST.hex()
        colon = ":".join(f"{b:02X}" for b in self.DIGEST)
        for text in [
            "sha256:" + hexed,
            "SHA256:" + hexed.upper(),
            hexed,
            colon,
            colon.lower(),
            "sha256:" + colon,
            "SHA256 Fingerprint=" + colon,
            f"  sha256={hexed}\n",
        ]:
            self.assertEqual(Fingerprint.parse(text), Fingerprint(self.DIGEST), text)

    def test_canonical(self) -> None:
        fingerprint = Fingerprint(self.DIGEST)
        self.assertEqual(str(fingerprint), "sha256:" + self.DIGEST.hex())
        self.assertEqual(
            fingerprint.colon_hex, ":".join(f"{b:02X}" for b in self.DIGEST)
        )

    def test_rejected(self) -> None:
        for text in [
            "",
            "sha256:",
            "sha1:" + "ab" * 32,
            "ab" * 31,
            "ab" * 33,
            "zz" * 32,
            ":".join(["ab"] * 31),
            ":".join(["abc"] * 32),
            "md5:" + ":".join(["ab"] * 32),
        ]:
            with self.assertRaises(ClusterError):
                Fingerprint.parse(text)

    @settings(deadline=None)
    @given(
        st.binary(min_size=32, max_size=32),
        st.sampled_from(["", "sha256:", "SHA256:", "sha256=", "SHA256 Fingerprint="]),
        st.booleans(),
        st.booleans(),
        st.sampled_from(["", " ", "\n", "\t "]),
    )
    def test_parse_renderings(
        self, digest: bytes, prefix: str, colons: bool, upper: bool, space: str
    ) -> None:
        """Any rendering of a digest parses back to it; str() is a fixed point."""
        body = ":".join(f"{b:02x}" for b in digest) if colons else digest.hex()
        text = space + prefix + (body.upper() if upper else body) + space
        fingerprint = Fingerprint.parse(text)
        self.assertEqual(fingerprint.digest, digest)
        self.assertEqual(Fingerprint.parse(str(fingerprint)), fingerprint)
        self.assertEqual(Fingerprint.parse(fingerprint.colon_hex), fingerprint)

    @settings(deadline=None)
    @given(st.text(max_size=120))
    def test_parse_garbage(self, text: str) -> None:
        """Arbitrary text parses or fails with ClusterError, nothing else."""
        try:
            Fingerprint.parse(text)
        except ClusterError as e:
            self.assertNotIn("\n", str(e))


class PeerTests(SynchronousTestCase):
    def test_normalized(self) -> None:
        peer = Peer("GPU-2", "[::1]", "AB:" * 31 + "AB", {"vllm": 8000, "ollama": 1})
        self.assertEqual(peer.id, "gpu-2")
        self.assertEqual(peer.address, "::1")
        self.assertEqual(peer.ports, (("ollama", 1), ("vllm", 8000)))
        self.assertEqual(peer.port("vllm"), 8000)
        self.assertIsNone(peer.port("lmstudio"))
        self.assertEqual(str(peer.fingerprint), "sha256:" + "ab" * 32)

    def test_invalid(self) -> None:
        fp = str(fake_fingerprint(1))
        for args in [
            ("10.0.0.1", "10.0.0.1", fp, {}),  # node id that reads as an address
            ("a_b", "10.0.0.1", fp, {}),
            ("", "10.0.0.1", fp, {}),
            ("gpu-2", "http://10.0.0.1", fp, {}),
            ("gpu-2", "10.0.0.1:8000", fp, {}),
            ("gpu-2", "10.0.0.1", "nope", {}),
            ("gpu-2", "10.0.0.1", fp, {"tgi": 80}),
            ("gpu-2", "10.0.0.1", fp, {"vllm": 0}),
            ("gpu-2", "10.0.0.1", fp, {"vllm": 65536}),
            ("gpu-2", "10.0.0.1", fp, {"vllm": True}),
            ("gpu-2", "10.0.0.1", fp, [("vllm", 1), ("vllm", 2)]),
        ]:
            with self.assertRaises(ClusterError, msg=repr(args)):
                Peer(*args)

    def test_ports_follow_the_engine_table(self) -> None:
        """
        C{ports} may name exactly the engines of L{nvproxy.engines.ENGINES}; an
        unknown one is refused with the table's engines listed.
        """
        ports = {engine: 1000 + n for n, engine in enumerate(sorted(ENGINE_TABLE))}
        peer = Peer("gpu-2", "10.0.0.1", fake_fingerprint(1), ports)
        self.assertEqual(dict(peer.ports), ports)
        with self.assertRaises(ClusterError) as caught:
            Peer("gpu-2", "10.0.0.1", fake_fingerprint(1), {"tgi": 80})
        self.assertIn(
            f"(known: {', '.join(sorted(ENGINE_TABLE))})", str(caught.exception)
        )

    def test_peer_at(self) -> None:
        a = Peer("a", "10.0.0.1", fake_fingerprint(1), {"ollama": 11435})
        b = Peer("b", "10.0.0.1", fake_fingerprint(2), {"ollama": 11436})
        c = Peer("c", "host.example", fake_fingerprint(3))
        d = Peer("d", "fd00::1", fake_fingerprint(4))
        state = ClusterState(None, (a, b, c, d))
        self.assertEqual(state.peer_at("10.0.0.1", 11435), a)
        self.assertEqual(state.peer_at("10.0.0.1", 11436), b)
        self.assertIsNone(state.peer_at("10.0.0.1", 8000))  # ambiguous
        self.assertEqual(state.peer_at("HOST.example", 8000), c)
        self.assertEqual(state.peer_at("host.example.", 8000), c)
        self.assertIsNone(state.peer_at("10.0.0.9", 11435))
        # an IPv6 address however the URL spells it
        self.assertEqual(state.peer_at("[fd00:0::1]", 8000), d)
        self.assertEqual(state.peer_at("FD00::0:1", 8000), d)
        self.assertEqual(
            state.pins, frozenset(fake_fingerprint(n) for n in (1, 2, 3, 4))
        )

    def test_peer_by_id_and_fingerprint(self) -> None:
        """
        Looked up, not searched; with two listings of a fingerprint or an
        id (a dir's pin and a fleet's record), the first listed is the one.
        """
        a = Peer("a", "10.0.0.1", fake_fingerprint(1))
        b = Peer("b", "10.0.0.2", fake_fingerprint(2))
        again = Peer("c", "10.0.0.3", fake_fingerprint(1))
        moved = Peer("b", "10.0.0.4", fake_fingerprint(4))
        state = ClusterState(None, (a, b, again, moved))
        self.assertEqual(state.peer_by_fingerprint(fake_fingerprint(1)), a)
        self.assertEqual(state.peer_by_fingerprint(fake_fingerprint(4)), moved)
        self.assertIsNone(state.peer_by_fingerprint(fake_fingerprint(9)))
        self.assertEqual(state.peer("b"), b)
        self.assertEqual(state.peer("c"), again)
        self.assertIsNone(state.peer("z"))
        self.assertEqual(state, ClusterState(None, (a, b, again, moved)))


class InitTests(SynchronousTestCase):
    def test_creates_identity(self) -> None:
        directory = ClusterDir(Path(self.mktemp()) / "nested" / "cluster")
        identity = directory.init("Node-A", clock_at())
        self.assertEqual(identity.node_id, "node-a")
        self.assertEqual(sorted(os.listdir(directory.path)), ["node.crt", "node.key"])
        self.assertEqual(stat.S_IMODE(directory.key_path.stat().st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(directory.path.stat().st_mode), 0o700)
        cert = x509.load_pem_x509_certificate(directory.cert_path.read_bytes())
        self.assertEqual(
            cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value, "node-a"
        )
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        self.assertEqual(san.value.get_values_for_type(x509.DNSName), ["node-a"])
        self.assertEqual(cert.not_valid_after_utc.year, 2025 + 10)
        key = identity.key
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self.assertEqual(key.curve.name, "secp256r1")

    def test_fingerprint_stable(self) -> None:
        directory = make_dir(self)
        identity = directory.init("node-a", clock_at())
        self.assertEqual(directory.fingerprint(), identity.fingerprint)
        self.assertEqual(directory.fingerprint(), directory.fingerprint())
        self.assertEqual(ClusterDir(directory.path).load().identity, identity)
        self.assertEqual(identity.fingerprint, Fingerprint.of(identity.certificate))

    def test_refuses_overwrite(self) -> None:
        directory = make_dir(self, "node-a")
        before = directory.key_path.read_bytes(), directory.cert_path.read_bytes()
        with self.assertRaises(ClusterError) as caught:
            directory.init("node-b", clock_at())
        self.assertIn("refusing to overwrite", str(caught.exception))
        after = directory.key_path.read_bytes(), directory.cert_path.read_bytes()
        self.assertEqual(before, after)

    def test_bad_node_id(self) -> None:
        directory = make_dir(self)
        with self.assertRaises(ClusterError):
            directory.init("not a name", clock_at())
        self.assertFalse(directory.path.exists())

    def test_not_initialized(self) -> None:
        directory = make_dir(self)
        self.assertEqual(directory.load(), ClusterState())
        self.assertFalse(directory.load().member)
        with self.assertRaises(ClusterError):
            directory.fingerprint()

    def test_half_identity(self) -> None:
        directory = make_dir(self, "node-a")
        directory.key_path.unlink()
        with self.assertRaises(ClusterError) as caught:
            directory.load()
        self.assertIn("node.key is missing", str(caught.exception))

    def test_mismatched_key(self) -> None:
        a, b = make_dir(self, "node-a"), make_dir(self, "node-b")
        a.key_path.write_bytes(b.key_path.read_bytes())
        with self.assertRaises(ClusterError) as caught:
            a.load()
        self.assertIn("does not match", str(caught.exception))


class PeersTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = make_dir(self, "node-a")
        self.b = Peer("node-b", "10.0.0.2", fake_fingerprint(2), {"ollama": 11435})
        self.c = Peer("node-c", "gpu-c.lan", fake_fingerprint(3))

    def test_round_trip(self) -> None:
        self.dir.add_peer(self.c)
        self.dir.add_peer(self.b)
        self.assertEqual(self.dir.peers(), (self.b, self.c))
        state = ClusterDir(self.dir.path).load()
        self.assertEqual(state.peers, (self.b, self.c))
        self.assertEqual(state.pins, {self.b.fingerprint, self.c.fingerprint})
        self.assertEqual(state.node_id, "node-a")
        document = json.loads(self.dir.peers_path.read_text())
        self.assertEqual(
            document,
            {
                "version": 1,
                "peers": [
                    {
                        "id": "node-b",
                        "address": "10.0.0.2",
                        "ports": {"ollama": 11435},
                        "fingerprint": str(fake_fingerprint(2)),
                    },
                    {
                        "id": "node-c",
                        "address": "gpu-c.lan",
                        "ports": {},
                        "fingerprint": str(fake_fingerprint(3)),
                    },
                ],
            },
        )

    def test_remove(self) -> None:
        self.dir.add_peer(self.b)
        self.dir.add_peer(self.c)
        self.assertEqual(self.dir.remove_peer("NODE-B"), self.b)
        self.assertEqual(self.dir.load().peers, (self.c,))
        with self.assertRaises(ClusterError):
            self.dir.remove_peer("node-b")

    def test_atomic_replace(self) -> None:
        """Each write replaces the file (new inode) and leaves no temp file."""
        self.dir.add_peer(self.b)
        first = self.dir.peers_path.stat().st_ino
        self.dir.add_peer(self.c)
        self.assertNotEqual(self.dir.peers_path.stat().st_ino, first)
        self.assertEqual(
            sorted(os.listdir(self.dir.path)), ["node.crt", "node.key", "peers.json"]
        )
        self.assertEqual(stat.S_IMODE(self.dir.peers_path.stat().st_mode), 0o644)

    def test_duplicates(self) -> None:
        self.dir.add_peer(self.b)
        with self.assertRaises(ClusterError):
            self.dir.add_peer(self.b)
        with self.assertRaises(ClusterError):
            self.dir.add_peer(Peer("node-x", "10.0.0.9", self.b.fingerprint))
        moved = Peer("node-b", "10.0.0.20", fake_fingerprint(9))
        self.dir.add_peer(moved, replace=True)
        self.assertEqual(self.dir.peers(), (moved,))

    def test_own_identity_refused(self) -> None:
        identity = self.dir.identity()
        assert identity is not None
        with self.assertRaises(ClusterError):
            self.dir.add_peer(Peer("node-a", "10.0.0.1", fake_fingerprint(7)))
        with self.assertRaises(ClusterError):
            self.dir.add_peer(Peer("node-z", "10.0.0.1", identity.fingerprint))

    def test_own_entry_skipped(self) -> None:
        """One peers.json listing every node can be shared by all of them."""
        identity = self.dir.identity()
        assert identity is not None
        me = Peer("node-a", "10.0.0.1", identity.fingerprint)
        self.write({"version": 1, "peers": [me.to_json(), self.b.to_json()]})
        self.assertEqual(self.dir.load().peers, (self.b,))
        self.assertEqual(len(self.dir.peers()), 2)

    def write(self, document: object) -> None:
        self.dir.peers_path.write_text(json.dumps(document))

    def test_hand_written_formats(self) -> None:
        """Hand edits may use colon-hex fingerprints and bracketed IPv6."""
        fp = fake_fingerprint(4)
        self.write(
            {
                "peers": [
                    {"id": "n4", "address": "[fe80::1]", "fingerprint": fp.colon_hex}
                ]
            }
        )
        self.assertEqual(self.dir.load().peers, (Peer("n4", "fe80::1", fp),))

    def test_parse_errors(self) -> None:
        """Each broken file gives one line naming the file and the problem."""
        good = self.b.to_json()
        cases: list[tuple[object, str]] = [
            ([], "expected an object"),
            ({"version": 2, "peers": []}, "unsupported version 2"),
            ({"peerz": []}, "unknown key 'peerz'"),
            ({"peers": {}}, '"peers" must be a list'),
            ({"peers": [1]}, "peer #1: expected an object"),
            ({"peers": [{"id": "x", "address": "h"}]}, "missing 'fingerprint'"),
            ({"peers": [{**good, "extra": 1}]}, "unknown key 'extra'"),
            ({"peers": [{**good, "ports": {"tgi": 1}}]}, "unknown engine 'tgi'"),
            ({"peers": [{**good, "ports": {"vllm": "80"}}]}, "port for vllm"),
            ({"peers": [{**good, "ports": []}]}, '"ports" must be an object'),
            ({"peers": [{**good, "id": 5}]}, "'id' must be a string"),
            ({"peers": [{**good, "fingerprint": "x"}]}, "not a SHA-256 fingerprint"),
            ({"peers": [good, good]}, "id listed twice"),
            (
                {"peers": [good, {**good, "id": "other"}]},
                "same fingerprint as node-b",
            ),
        ]
        for document, expected in cases:
            self.write(document)
            with self.assertRaises(ClusterError, msg=repr(document)) as caught:
                self.dir.load()
            message = str(caught.exception)
            self.assertIn(expected, message)
            self.assertIn("peers.json", message)
            self.assertNotIn("\n", message)
        self.dir.peers_path.write_bytes(b"{not json")
        with self.assertRaises(ClusterError) as caught:
            self.dir.load()
        self.assertIn("not valid JSON", str(caught.exception))


PEERS = st.builds(
    Peer,
    st.from_regex(r"[a-z][a-z0-9-]{0,8}[a-z]", fullmatch=True),
    st.ip_addresses().map(str)
    | st.from_regex(r"[a-z]{1,8}(\.[a-z]{1,8}){0,2}", fullmatch=True),
    st.binary(min_size=32, max_size=32).map(Fingerprint),
    st.dictionaries(st.sampled_from(ENGINES), st.integers(1, 65535)),
)


class PeersPropertyTests(SynchronousTestCase):
    @settings(deadline=None, max_examples=50)
    @given(
        st.lists(PEERS, max_size=6, unique_by=(lambda p: p.id, lambda p: p.fingerprint))
    )
    def test_round_trip(self, peers: list[Peer]) -> None:
        """Whatever is added comes back from load, sorted by id."""
        directory = ClusterDir(self.mktemp())
        for peer in peers:
            directory.add_peer(peer)
        self.assertEqual(
            directory.load(),
            ClusterState(None, tuple(sorted(peers, key=lambda p: p.id))),
        )
        for peer in peers:
            directory.remove_peer(peer.id)
        self.assertEqual(directory.load(), ClusterState())


class WatcherTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = make_dir(self, "node-a")
        self.clock = Clock()
        self.watcher = ClusterWatcher(self.dir, self.clock, interval=2.0)
        self.seen: list[ClusterState] = []
        self.unsubscribe = self.watcher.subscribe(self.seen.append)
        self.watcher.startService()
        self.addCleanup(self.stop)
        self.b = Peer("node-b", "10.0.0.2", fake_fingerprint(2))

    def stop(self) -> None:
        if self.watcher.running:
            self.watcher.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_initial(self) -> None:
        self.assertEqual(self.watcher.current.node_id, "node-a")
        self.assertEqual(self.watcher.current.peers, ())
        self.assertEqual(self.seen, [])

    def test_change_noticed_on_next_poll(self) -> None:
        self.dir.add_peer(self.b)
        self.assertEqual(self.watcher.current.pins, frozenset())
        self.clock.advance(2.0)
        self.assertEqual(self.watcher.current.pins, {self.b.fingerprint})
        self.assertEqual(self.seen, [self.watcher.current])
        self.clock.advance(2.0)
        self.assertEqual(len(self.seen), 1)  # nothing changed since

    def test_rewrite_with_same_content(self) -> None:
        """A changed file with an equal state notifies nobody."""
        self.dir.add_peer(self.b)
        self.clock.advance(2.0)
        self.dir.remove_peer("node-b")
        self.dir.add_peer(self.b)
        self.clock.advance(2.0)
        self.assertEqual(len(self.seen), 1)

    def test_broken_keeps_last_good(self) -> None:
        self.dir.add_peer(self.b)
        self.clock.advance(2.0)
        good = self.watcher.current
        self.dir.peers_path.write_text("{")
        self.clock.advance(2.0)
        self.assertIs(self.watcher.current, good)
        self.assertIsInstance(self.watcher.error, ClusterError)
        self.dir.peers_path.unlink()
        self.clock.advance(2.0)
        self.assertIsNone(self.watcher.error)
        self.assertEqual(self.watcher.current.peers, ())
        self.assertEqual(len(self.seen), 2)

    def test_unsubscribe(self) -> None:
        self.unsubscribe()
        self.unsubscribe()
        self.dir.add_peer(self.b)
        self.assertEqual(self.watcher.reload().pins, {self.b.fingerprint})
        self.assertEqual(self.seen, [])

    def test_subscriber_failure_contained(self) -> None:
        def boom(state: ClusterState) -> None:
            raise RuntimeError("boom")

        self.watcher.subscribe(boom)
        after: list[ClusterState] = []
        self.watcher.subscribe(after.append)
        self.dir.add_peer(self.b)
        self.clock.advance(2.0)
        self.assertEqual(len(after), 1)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertTrue(self.watcher.running)

    def test_stop(self) -> None:
        self.watcher.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.dir.add_peer(self.b)
        self.clock.advance(10)
        self.assertEqual(self.seen, [])


class CommandTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.path = self.mktemp()

    def run_command(self, *argv: str) -> tuple[int, str]:
        out = io.StringIO()
        code = cluster_command(
            [*argv], out, clock=clock_at(), environ={"NVPROXY_CLUSTER_DIR": self.path}
        )
        return code, out.getvalue()

    def test_init_and_fingerprint(self) -> None:
        code, output = self.run_command("init", "node-a")
        self.assertEqual(code, 0)
        fingerprint = str(ClusterDir(self.path).fingerprint())
        self.assertEqual(
            output,
            f"initialized node node-a in {self.path}\nfingerprint {fingerprint}\n",
        )
        self.assertEqual(self.run_command("fingerprint"), (0, fingerprint + "\n"))
        code, output = self.run_command("init", "node-a")
        self.assertEqual(code, 1)
        self.assertIn("refusing to overwrite", output)

    def test_dir_option(self) -> None:
        other = self.mktemp()
        self.assertEqual(self.run_command("init", "node-a", "--dir", other)[0], 0)
        self.assertTrue(ClusterDir(other).load().member)
        self.assertFalse(ClusterDir(self.path).cert_path.exists())

    def test_peers(self) -> None:
        fp = fake_fingerprint(5)
        code, output = self.run_command(
            "add-peer", "node-b", "10.0.0.2", fp.colon_hex, "--port", "vllm=8000",
            "--port", "ollama=11435",
        )  # fmt: skip
        self.assertEqual(code, 0, output)
        self.assertEqual(output, f"added peer node-b at 10.0.0.2 ({fp})\n")
        self.assertEqual(
            self.run_command("list"),
            (0, f"node-b\t10.0.0.2\tollama=11435,vllm=8000\t{fp}\n"),
        )
        code, output = self.run_command("add-peer", "node-b", "10.0.0.3", str(fp))
        self.assertEqual(code, 1)
        self.assertIn("already exists", output)
        self.assertEqual(
            self.run_command("remove-peer", "node-b"), (0, "removed peer node-b\n")
        )
        code, output = self.run_command("remove-peer", "node-b")
        self.assertEqual(code, 1)
        self.assertTrue(output.startswith("nvproxyctl cluster remove-peer: no peer"))

    def test_errors(self) -> None:
        fp = str(fake_fingerprint(5))
        for argv, code in [
            ([], 2),
            (["frobnicate"], 2),
            (["init"], 2),
            (["add-peer", "node-b", "10.0.0.2"], 2),
            (["add-peer", "node-b", "10.0.0.2", fp, "--port", "vllm"], 2),
            (["add-peer", "node-b", "10.0.0.2", fp, "--port", "tgi=80"], 1),
            (["add-peer", "node-b", "10.0.0.2", "sha256:123"], 1),
            (["init", "bad name"], 1),
            (["fingerprint"], 1),
        ]:
            result, output = self.run_command(*argv)
            self.assertEqual(result, code, (argv, output))
            self.assertTrue(output.endswith("\n"), output)

    def test_help(self) -> None:
        code, output = self.run_command("--help")
        self.assertEqual(code, 0)
        self.assertIn("add-peer", output)

    def test_through_nvproxyctl(self) -> None:
        """
        C{nvproxyctl cluster ...} runs these commands with the process's clock:
        the certificate it makes is valid now.
        """
        out = io.StringIO()
        self.assertEqual(
            main(["cluster", "init", "node-a", "--dir", self.path], out), 0
        )
        self.assertTrue(out.getvalue().startswith("initialized node node-a in "))
        identity = ClusterDir(self.path).identity()
        assert identity is not None
        certificate = identity.certificate
        now = reactor.seconds()
        self.assertLessEqual(certificate.not_valid_before_utc.timestamp(), now)
        self.assertGreater(certificate.not_valid_after_utc.timestamp(), now)
        out = io.StringIO()
        self.assertEqual(main(["cluster", "list", "--dir", self.path], out), 0)
        self.assertEqual(out.getvalue(), "")


class ServerTLSUnitTests(SynchronousTestCase):
    def test_interfaces(self) -> None:
        state = ClusterState()
        verifyObject(IPolicyForHTTPS, PeerPolicyForHTTPS(lambda: state))

    def test_context_follows_identity(self) -> None:
        """A new identity gets a new context; the same one reuses it."""
        a, b = make_dir(self, "node-a").load(), make_dir(self, "node-b").load()
        current = [a]
        server = ServerTLS(lambda: current[0])
        first = server.serverConnectionForTLS(None).get_context()
        self.assertIs(server.serverConnectionForTLS(None).get_context(), first)
        current[0] = ClusterState(
            a.identity, (Peer("x", "10.0.0.1", fake_fingerprint(1)),)
        )
        self.assertIs(server.serverConnectionForTLS(None).get_context(), first)
        current[0] = b
        self.assertIsNot(server.serverConnectionForTLS(None).get_context(), first)

    def test_client_creators_kept_per_peer(self) -> None:
        """
        Dialing the same peer as the same identity reuses its creator, and so
        its SSL context; a changed pin or identity gets a new one; the cache
        starts again once it outgrows the cluster.
        """
        a, b = make_dir(self, "node-a").load(), make_dir(self, "node-b").load()
        assert a.identity is not None and b.identity is not None
        peer = Peer("node-c", "10.0.0.3", fake_fingerprint(3))
        state = ClusterState(a.identity, (peer,))
        cache = ClientTLSCache()
        first = cache.creator(state, peer)
        assert first is not None
        self.assertIs(cache.creator(state, peer), first)
        self.assertEqual(
            (first.identity, first.node_id, first.fingerprint),
            (a.identity, "node-c", peer.fingerprint),
        )
        repinned = Peer("node-c", "10.0.0.3", fake_fingerprint(4))
        other = cache.creator(ClusterState(a.identity, (repinned,)), repinned)
        assert other is not None
        self.assertIsNot(other, first)
        self.assertEqual(other.fingerprint, repinned.fingerprint)
        as_b = cache.creator(ClusterState(b.identity, (peer,)), peer)
        self.assertIsNot(as_b, first)
        self.assertIsNone(cache.creator(ClusterState(None, (peer,)), peer))
        for n in range(30):
            moved = Peer("node-c", f"10.0.1.{n}", fake_fingerprint(3))
            cache.creator(ClusterState(a.identity, (moved,)), moved)
        self.assertIsNot(cache.creator(state, peer), first)

    def test_policy_reuses_creators(self) -> None:
        """The Agent policy hands out one creator per pinned peer."""
        a = make_dir(self, "node-a").load()
        assert a.identity is not None
        peer = Peer("node-c", "10.0.0.3", fake_fingerprint(3), {"ollama": 8443})
        state = ClusterState(a.identity, (peer,))
        policy = PeerPolicyForHTTPS(lambda: state, FixedPolicy(NoCertificateClient()))
        first = policy.creatorForNetloc(b"10.0.0.3", 8443)
        self.assertIsInstance(first, ClientTLS)
        self.assertIs(policy.creatorForNetloc(b"10.0.0.3", 8443), first)
        self.assertIsInstance(
            policy.creatorForNetloc(b"10.0.0.9", 8443), NoCertificateClient
        )

    def test_peer_fingerprint_plaintext(self) -> None:
        self.assertIsNone(peer_fingerprint(StringTransport()))
        server = ServerTLS(ClusterState)
        self.assertFalse(server.peer_is_pinned(StringTransport()))
        self.assertIsNone(server.peer(StringTransport()))

    def test_peer_fingerprint_once_per_connection(self) -> None:
        """
        A connection's certificate cannot change (TLS 1.3 only, no
        renegotiation): its fingerprint is computed once, while whether it is
        still pinned is asked on every request.
        """
        a, b = make_dir(self, "node-a").load(), make_dir(self, "node-b").load()
        transport = _CertificateTransport(b.identity.certificate)
        other = _CertificateTransport(a.identity.certificate)
        expected = Fingerprint.of(b.identity.certificate)
        self.assertEqual(peer_fingerprint(transport), expected)
        self.assertEqual(peer_fingerprint(transport), expected)
        self.assertEqual(transport.asked, 1)
        self.assertEqual(
            peer_fingerprint(other), Fingerprint.of(a.identity.certificate)
        )
        current = [ClusterState(a.identity, (Peer("node-b", "127.0.0.1", expected),))]
        server = ServerTLS(lambda: current[0])
        self.assertTrue(server.peer_is_pinned(transport))
        current[0] = ClusterState(a.identity, ())
        self.assertFalse(server.peer_is_pinned(transport))
        self.assertEqual(transport.asked, 1)

    def test_no_certificate_yet_not_remembered(self) -> None:
        a = make_dir(self, "node-a").load()
        transport = _CertificateTransport(None)
        self.assertIsNone(peer_fingerprint(transport))
        transport.certificate = a.identity.certificate
        self.assertEqual(
            peer_fingerprint(transport), Fingerprint.of(a.identity.certificate)
        )


@implementer(ISSLTransport)
class _CertificateTransport(StringTransport):
    """A TLS transport as far as L{peer_fingerprint} looks, counting asks."""

    def __init__(self, certificate: x509.Certificate | None) -> None:
        super().__init__()
        self.certificate = certificate
        self.asked = 0

    def getPeerCertificate(self) -> x509.Certificate | None:
        self.asked += 1
        return self.certificate


# -- real TLS on loopback ------------------------------------------------------------


class Echo(Resource):
    """Answers with the client certificate's CN, if the client is still pinned."""

    isLeaf = True

    def __init__(self, server: ServerTLS) -> None:
        super().__init__()
        self.server = server
        self.channels: list[object] = []

    def render_GET(self, request: Request) -> bytes:
        self.channels.append(request.channel)
        if not self.server.peer_is_pinned(request.transport):
            request.setResponseCode(403)
            return b"not pinned"
        peer = self.server.peer(request.transport)
        certificate = request.transport.getPeerCertificate().to_cryptography()
        [cn] = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        return f"hello {cn.value} ({peer.id if peer else None})".encode()


class Plain(Resource):
    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        return b"plain " + request.getClientAddress().host.encode()


class Tracking(WrappingFactory):
    """Tracks server-side connections so a test can close them all and wait."""

    def __init__(self, wrapped: DemuxFactory) -> None:
        super().__init__(wrapped)
        self.waiting: list[Deferred[None]] = []

    def unregisterProtocol(self, p: object) -> None:
        super().unregisterProtocol(p)
        if not self.protocols:
            waiting, self.waiting = self.waiting, []
            for d in waiting:
                d.callback(None)

    def close_all(self) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        if not self.protocols:
            d.callback(None)
            return d
        self.waiting.append(d)
        for p in list(self.protocols):
            p.transport.abortConnection()
        return d


@implementer(IOpenSSLClientConnectionCreator)
class NoCertificateClient:
    """A TLS client that presents no certificate and trusts any server."""

    def clientConnectionForTLS(self, tlsProtocol: object) -> SSL.Connection:
        context = SSL.Context(SSL.TLS_METHOD)
        context.set_verify(SSL.VERIFY_NONE)
        connection = SSL.Connection(context, None)
        connection.set_app_data(tlsProtocol)
        return connection


@implementer(IPolicyForHTTPS)
class FixedPolicy:
    def __init__(self, creator: IOpenSSLClientConnectionCreator) -> None:
        self.creator = creator

    def creatorForNetloc(
        self, hostname: bytes, port: int
    ) -> IOpenSSLClientConnectionCreator:
        return self.creator


def reasons(failure: Failure) -> list[type[BaseException]]:
    """The exception types inside an Agent failure (ResponseFailed wraps a list)."""
    value = failure.value
    if isinstance(value, ResponseNeverReceived | ResponseFailed):
        return [type(r.value) for r in value.reasons]
    return [type(value)]


class LoopbackTLSTests(TestCase):
    """
    Node A serves a facade-like port (plaintext + mTLS through DemuxFactory) on
    127.0.0.1; nodes B and C dial it with real TLS.
    """

    timeout = 30

    def setUp(self) -> None:
        self.a_dir = make_dir(self, "node-a")
        self.b_dir = make_dir(self, "node-b")
        self.c_dir = make_dir(self, "node-c")
        self.b_id = self.identity(self.b_dir)
        self.c_id = self.identity(self.c_dir)
        self.a_dir.add_peer(Peer("node-b", "127.0.0.1", self.b_id.fingerprint))
        self.watcher = ClusterWatcher(self.a_dir, reactor, interval=3600)
        self.server = ServerTLS(lambda: self.watcher.current)
        self.echo = Echo(self.server)
        demux = DemuxFactory(
            Site(Plain()),
            tls_personality(self.server, Site(self.echo), reactor),
            reactor,
            first_byte_timeout=10,
        )
        self.tracking = Tracking(demux)
        port: IListeningPort = reactor.listenTCP(
            0, self.tracking, interface="127.0.0.1"
        )
        self.port_number = port.getHost().port
        self.url = f"https://127.0.0.1:{self.port_number}/".encode()
        self.addCleanup(self.tracking.close_all)
        self.addCleanup(port.stopListening)

    def identity(self, directory: ClusterDir) -> Identity:
        identity = directory.identity()
        assert identity is not None
        return identity

    def client_state(
        self, me: Identity, peer_id: str, fingerprint: Fingerprint
    ) -> ClusterState:
        """What dialing node C{me} knows: node A at our port, with these pins."""
        peer = Peer(peer_id, "127.0.0.1", fingerprint, {"ollama": self.port_number})
        return ClusterState(me, (peer,))

    def agent(self, policy: IPolicyForHTTPS, persistent: bool = False) -> Agent:
        pool = HTTPConnectionPool(reactor, persistent=persistent)
        self.addCleanup(pool.closeCachedConnections)
        return Agent(reactor, contextFactory=policy, pool=pool)

    def pinned_agent(self, me: Identity, persistent: bool = False) -> Agent:
        a_fp = self.a_dir.fingerprint()
        state = self.client_state(me, "node-a", a_fp)
        return self.agent(PeerPolicyForHTTPS(lambda: state), persistent)

    @inlineCallbacks
    def get(self, agent: Agent, url: bytes | None = None) -> Any:
        d = agent.request(b"GET", url or self.url)
        d.addTimeout(10, reactor)
        response = yield d
        body = yield readBody(response)
        return response.code, body

    @inlineCallbacks
    def test_pinned_client_accepted(self) -> Any:
        result = yield self.get(self.pinned_agent(self.b_id))
        self.assertEqual(result, (200, b"hello node-b (node-b)"))

    @inlineCallbacks
    def test_unpinned_client_refused(self) -> Any:
        failure = yield self.assertFailure(
            self.get(self.pinned_agent(self.c_id)),
            ResponseNeverReceived,
            ResponseFailed,
        )
        self.assertIn(SSL.Error, reasons(Failure(failure)))
        self.assertEqual(self.echo.channels, [])

    @inlineCallbacks
    def test_client_without_certificate_refused(self) -> Any:
        agent = self.agent(FixedPolicy(NoCertificateClient()))
        failure = yield self.assertFailure(
            self.get(agent), ResponseNeverReceived, ResponseFailed
        )
        self.assertIn(SSL.Error, reasons(Failure(failure)))
        self.assertEqual(self.echo.channels, [])

    @inlineCallbacks
    def test_pin_added_at_runtime(self) -> Any:
        yield self.assertFailure(
            self.get(self.pinned_agent(self.c_id)),
            ResponseNeverReceived,
            ResponseFailed,
        )
        self.a_dir.add_peer(Peer("node-c", "127.0.0.1", self.c_id.fingerprint))
        self.watcher.check()
        result = yield self.get(self.pinned_agent(self.c_id))
        self.assertEqual(result, (200, b"hello node-c (node-c)"))

    @inlineCallbacks
    def test_pin_removed_with_keepalive_open(self) -> Any:
        agent = self.pinned_agent(self.b_id, persistent=True)
        result = yield self.get(agent)
        self.assertEqual(result, (200, b"hello node-b (node-b)"))
        self.a_dir.remove_peer("node-b")
        self.watcher.check()
        result = yield self.get(agent)
        self.assertEqual(result, (403, b"not pinned"))
        [first, second] = self.echo.channels
        self.assertIs(first, second)  # the same keep-alive connection
        yield self.assertFailure(
            self.get(self.pinned_agent(self.b_id)),
            ResponseNeverReceived,
            ResponseFailed,
        )
        self.assertEqual(len(self.echo.channels), 2)

    @inlineCallbacks
    def test_dialer_rejects_wrong_fingerprint(self) -> Any:
        state = self.client_state(self.b_id, "node-a", self.c_id.fingerprint)
        agent = self.agent(PeerPolicyForHTTPS(lambda: state))
        failure = yield self.assertFailure(
            self.get(agent), ResponseNeverReceived, ResponseFailed
        )
        self.assertEqual(reasons(Failure(failure)), [PeerVerificationError])
        self.assertEqual(self.echo.channels, [])

    @inlineCallbacks
    def test_dialer_rejects_wrong_node_id(self) -> Any:
        """The pinned certificate must also name the node we meant to reach."""
        state = self.client_state(self.b_id, "node-z", self.a_dir.fingerprint())
        agent = self.agent(PeerPolicyForHTTPS(lambda: state))
        failure = yield self.assertFailure(
            self.get(agent), ResponseNeverReceived, ResponseFailed
        )
        self.assertEqual(reasons(Failure(failure)), [PeerVerificationError])
        self.assertIn("node-z", str(failure.reasons[0].value))

    @inlineCallbacks
    def test_client_tls_direct(self) -> Any:
        """ClientTLS works without the policy, e.g. behind a custom endpoint."""
        creator = ClientTLS(self.b_id, "node-a", self.a_dir.fingerprint())
        result = yield self.get(self.agent(FixedPolicy(creator)))
        self.assertEqual(result, (200, b"hello node-b (node-b)"))

    @inlineCallbacks
    def test_unknown_host_uses_fallback(self) -> Any:
        """An address that is no peer's gets the fallback policy."""
        state = ClusterState(self.b_id, ())
        agent = self.agent(
            PeerPolicyForHTTPS(lambda: state, FixedPolicy(NoCertificateClient()))
        )
        yield self.assertFailure(self.get(agent), ResponseNeverReceived, ResponseFailed)

    @inlineCallbacks
    def test_plaintext_same_port(self) -> Any:
        agent = self.agent(FixedPolicy(NoCertificateClient()))
        url = f"http://127.0.0.1:{self.port_number}/".encode()
        result = yield self.get(agent, url)
        self.assertEqual(result, (200, b"plain 127.0.0.1"))

    @inlineCallbacks
    def test_silent_connection_dropped(self) -> Any:
        """A real connection that never sends a byte is closed at the timeout."""
        lost: Deferred[None] = Deferred()

        class Silent(Protocol):
            def connectionLost(self, reason: Failure = connectionDone) -> None:
                lost.callback(None)

        demux = self.tracking.wrappedFactory
        demux.first_byte_timeout = 0.2
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.port_number)
        yield endpoint.connect(Factory.forProtocol(Silent))
        lost.addTimeout(5, reactor)
        yield lost
