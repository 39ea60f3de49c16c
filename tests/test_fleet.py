"""
The fleet (DESIGN §3): sleep-aware ordering across nodes and node drain.

Unit: the chosen owner over random fleets (hypothesis), drained nodes
ordered last, the drain state persisted.  Integration: three nodes over
pinned mTLS on loopback, each with a fake vLLM serving the same model.
"""

from __future__ import annotations

import json
import os
from typing import Any

from attrs import evolve
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.http_headers import Headers

from nvproxy.accounting import Accounting
from nvproxy.cluster import PeerPolicyForHTTPS
from nvproxy.config import VllmHold, VllmServiceConfig
from nvproxy.discovery import Endpoint, NodeEntry, Snapshot
from nvproxy.drain import DrainState
from nvproxy.engines import ENGINES, RouteKind
from nvproxy.metrics import Metrics
from nvproxy.outliers import OutlierTable
from nvproxy.readiness import READINESS, ModelReadiness
from nvproxy.scheduler import ReservationMap, SchedulerSnapshot, choose, order_owners
from nvproxy.service import NvProxy
from nvproxy.testing.fakevllm import FakeVLLM
from nvproxy.testing.harness import (
    facade_url,
    nvproxyctl,
    pinned_cluster,
    proxy_config,
    start_proxy,
)
from nvproxy.workload import WorkloadRecorder
from tests.test_forwarding import ProxyTestCase

# -- ordering over random fleets ---------------------------------------------

_owner = st.tuples(
    st.sampled_from(READINESS),
    st.sampled_from([0.0, 1.0, 6.0, 45.0]),
    st.integers(0, 3),  # load
)


@st.composite
def _fleets(draw: Any) -> tuple[dict[str, Any], list[str], str | None]:
    nodes = draw(
        st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=6, unique=True)
    )
    owners = {n: draw(_owner) for n in nodes}
    priority = draw(st.lists(st.sampled_from("abcdefgh"), max_size=3, unique=True))
    pin = draw(st.one_of(st.none(), st.sampled_from("abcdefgh")))
    return owners, priority, pin


class OrderingTests(SynchronousTestCase):
    @given(_fleets())
    def test_chosen_owner_is_the_readiest(
        self, fleet: tuple[dict[str, Any], list[str], str | None]
    ) -> None:
        """
        The chosen owner is never less ready than another eligible owner
        unless it is pinned or on the scheduler's priority list.
        """
        owners, priority, pin = fleet
        rank = {
            n: ModelReadiness(r, 0.0 if r == "awake" else e).rank
            for n, (r, e, _) in owners.items()
        }
        reservations = ReservationMap()
        reservations.apply_snapshot(
            SchedulerSnapshot(
                1, priority, {n: load for n, (_, _, load) in owners.items()}
            )
        )
        ordered = order_owners(
            owners,
            pin=pin,
            snapshot=reservations.snapshot,
            loads=reservations.load,
            readiness=rank.__getitem__,
        )
        self.assertEqual(sorted(ordered), sorted(owners))
        chosen, _ = choose(
            ordered, pin in owners, reservations, readiness=rank.__getitem__
        )
        first = chosen[0]
        if first == pin or first in priority:
            return
        for other in owners:
            self.assertLessEqual(rank[first], rank[other], (first, other, fleet))
        # and the rest of the order never puts a less ready one first
        unlisted = [n for n in chosen if n != pin and n not in priority]
        classes = [rank[n][0] for n in unlisted[1:]]
        self.assertEqual(classes, sorted(classes))


def _entry(node: str, kind: Any = "peer", draining: bool = False) -> NodeEntry:
    endpoint = Endpoint(node, "vllm", kind, f"https://{node}")
    return NodeEntry(node, kind, {"M": endpoint}, (endpoint,), draining=draining)


def _accounting(
    pins: dict[str, str] | None = None, outliers: OutlierTable | None = None
) -> Accounting:
    clock = Clock()
    return Accounting(
        clock,
        ReservationMap(),
        WorkloadRecorder(clock, [], run_id="r", originated_from="a"),
        Metrics(CollectorRegistry()),
        pins or {},
        outliers,
    )


class DrainOrderTests(SynchronousTestCase):
    def accounting(self, pins: dict[str, str] | None = None) -> Accounting:
        return _accounting(pins)

    def order(self, accounting: Accounting, entries: list[NodeEntry]) -> list[str]:
        request = accounting.begin(
            ENGINES["vllm"],
            "M",
            RouteKind.INFERENCE,
            readiness=lambda entry, model: entry.readiness_of(model),
        )
        return [e.node_id for e in request.order(entries)]

    def test_draining_last_even_pinned(self) -> None:
        entries = [_entry("a", "local", draining=True), _entry("b"), _entry("c")]
        self.assertEqual(self.order(self.accounting(), entries), ["b", "c", "a"])
        pinned = self.accounting({"vllm": "a"})
        self.assertEqual(self.order(pinned, entries), ["b", "c", "a"])

    def test_only_owner_still_chosen(self) -> None:
        entries = [_entry("a", "local", draining=True)]
        self.assertEqual(self.order(self.accounting(), entries), ["a"])

    def test_in_flight_counted(self) -> None:
        accounting = self.accounting()
        self.order(accounting, [_entry("b")])
        self.order(accounting, [_entry("b")])
        self.assertEqual(accounting.in_flight, {"vllm": 2})


class SnapshotRanksTests(SynchronousTestCase):
    def test_snapshot_ranks_taken_this_node_asked(self) -> None:
        """
        A round takes the other owners' readiness from the snapshot's ranks
        and asks the backend only about this node's own entry, whose
        readiness is live: the order is the one asking every owner gives.
        """
        here = _entry("a", "local")
        waking = evolve(_entry("b"), readiness={"M": ModelReadiness("waking", 2.0)})
        entries = {e.node_id: e for e in (here, waking, _entry("c"))}
        snapshot = Snapshot(1, {"vllm": entries})
        asked: list[str] = []

        def readiness(entry: NodeEntry, model: str | None) -> ModelReadiness:
            asked.append(entry.node_id)
            if entry.kind == "local":
                return ModelReadiness("sleeping", 5.0)  # live, not in the snapshot
            return entry.readiness_of(model)

        orders = []
        for ranks in (snapshot.ranks("vllm", "M"), None):
            asked.clear()
            request = _accounting().begin(
                ENGINES["vllm"], "M", RouteKind.INFERENCE, readiness=readiness
            )
            owners = snapshot.owners("vllm", "M")
            orders.append([e.node_id for e in request.order(owners, ranks)])
            self.assertEqual(sorted(asked), ["a"] if ranks else ["a", "b", "c"])
        self.assertEqual(orders, [["c", "b", "a"], ["c", "b", "a"]])


_LINEUP_NODES = tuple(f"n{i:02}" for i in range(14))
_lineup_node = st.sampled_from(_LINEUP_NODES)


def _seven_owners(**changes: Any) -> dict[str, Any]:
    """An example for L{LineupTests}: seven awake owners, nothing else."""
    return {
        "owners": [f"n{i:02}" for i in range(7)],
        "local": False,
        "state": {},
        "live_state": None,
        "draining": set(),
        "reserved": [],
        "pending": None,
        "listed": [],
        "pin": None,
        "out": set(),
        "limit": 2,
        **changes,
    }


class LineupTests(SynchronousTestCase):
    """
    A round cut to the first C{limit} owners of a snapshot's lineup
    (L{RequestAccounting.first}) is the full order's head, with the same
    reservation, whatever loads, ejections, readiness, drains, pins and
    scheduler lists the fleet has.
    """

    @given(
        owners=st.lists(_lineup_node, min_size=1, max_size=14, unique=True),
        local=st.booleans(),
        state=st.dictionaries(
            _lineup_node,
            st.sampled_from(
                [
                    ModelReadiness("awake", 0.0),
                    ModelReadiness("waking", 2.0),
                    ModelReadiness("sleeping", 5.0),
                    ModelReadiness("sleeping", 30.0),
                ]
            ),
        ),
        live_state=st.sampled_from([None, "awake", "sleeping"]),
        draining=st.sets(_lineup_node),
        reserved=st.lists(_lineup_node, max_size=10),
        pending=st.none() | st.dictionaries(_lineup_node, st.integers(0, 3)),
        listed=st.lists(st.sampled_from((*_LINEUP_NODES, "x")), max_size=4),
        pin=st.none() | st.sampled_from((*_LINEUP_NODES, "x")),
        out=st.sets(_lineup_node),
        limit=st.integers(1, 6),
    )
    @settings(deadline=None, max_examples=1000)
    # the scheduler lists loaded owners: the least loaded listed is picked
    @example(
        **_seven_owners(
            pending={"n03": 3, "n04": 1, "n05": 2}, listed=["n03", "n04", "n05"]
        )
    )
    # every owner ejected: the pick is still among the listed
    @example(
        **_seven_owners(
            pending={"n03": 2, "n05": 0},
            listed=["n03", "n05"],
            out={f"n{i:02}" for i in range(7)},
            limit=3,
        )
    )
    def test_first_is_the_orders_head(
        self,
        owners: list[str],
        local: bool,
        state: dict[str, ModelReadiness],
        live_state: str | None,
        draining: set[str],
        reserved: list[str],
        pending: dict[str, int] | None,
        listed: list[str],
        pin: str | None,
        out: set[str],
        limit: int,
    ) -> None:
        entries = {
            node: evolve(
                _entry(node, "local" if local and i == 0 else "peer", node in draining),
                readiness={"M": state[node]} if node in state else {},
            )
            for i, node in enumerate(owners)
        }
        snapshot = Snapshot(1, {"vllm": entries})

        def readiness(entry: NodeEntry, model: str | None) -> ModelReadiness:
            if entry.kind == "local" and live_state is not None:
                return ModelReadiness(live_state, 0.0 if live_state == "awake" else 7.0)
            return entry.readiness_of(model)

        rounds = []
        for cut in (True, False):
            clock = Clock()
            outliers = OutlierTable(clock)
            for node in out:
                outliers.transport_failed("vllm", node)
            accounting = _accounting({"vllm": pin} if pin else None, outliers)
            reservations = accounting.reservations
            if pending is not None:
                reservations.apply_snapshot(SchedulerSnapshot(1, listed, pending))
            for node in reserved:
                reservations.reserve(node)
            request = accounting.begin(
                ENGINES["vllm"], "M", RouteKind.INFERENCE, readiness=readiness
            )
            if cut:
                ordered = request.first(snapshot.lineup("vllm", "M"), limit)
            else:
                ordered = request.order(
                    snapshot.owners("vllm", "M"), snapshot.ranks("vllm", "M")
                )[:limit]
            counts = {node: reservations.reservations(node) for node in owners}
            rounds.append(([entry.node_id for entry in ordered], counts))
        self.assertEqual(rounds[0], rounds[1])

    def test_looks_at_no_more_than_it_lists(self) -> None:
        """
        A round of a thousand owners, three hundred of them carrying a load,
        looks up the rank of only the owners it lists (and of the lineup's
        first): the lineup's order is worked out once per snapshot, and the
        loaded owners cannot come before unloaded ones as ready.
        """
        entries = {f"n{i:04}": _entry(f"n{i:04}") for i in range(1000)}
        snapshot = Snapshot(1, {"vllm": entries})
        lineup = snapshot.lineup("vllm", "M")
        self.assertIs(snapshot.lineup("vllm", "M"), lineup)
        looked: list[str] = []

        class Ranks(dict[str, tuple[int, float]]):
            def __getitem__(self, node: str) -> tuple[int, float]:
                looked.append(node)
                return super().__getitem__(node)

        lineup = evolve(lineup, ranks=Ranks(lineup.ranks))
        accounting = _accounting()
        for i in range(300):
            accounting.reservations.reserve(f"n{i:04}")

        def first(limit: int) -> list[str]:
            request = accounting.begin(
                ENGINES["vllm"],
                "M",
                RouteKind.INFERENCE,
                readiness=lambda entry, model: entry.readiness_of(model),
            )
            return [entry.node_id for entry in request.first(lineup, limit)]

        listed = [f"n{i:04}" for i in range(300, 305)]
        self.assertEqual(first(5), listed)
        self.assertEqual(sorted(looked), ["n0000", *listed])
        self.assertEqual(accounting.reservations.reservations("n0300"), 1)
        # the next round spreads: that owner now carries a load
        self.assertEqual(first(2), ["n0301", "n0302"])

    def test_unknown_model_not_kept(self) -> None:
        snapshot = Snapshot(1, {"vllm": {"a": _entry("a")}})
        self.assertEqual(snapshot.lineup("vllm", "nope").entries, ())
        self.assertEqual(snapshot._lineups, {})


class CtlTests(SynchronousTestCase):
    def test_drain_commands(self) -> None:
        from nvproxy.ctl import _parser, _request

        self.assertEqual(
            _request(_parser().parse_args(["drain"])), ("POST", "/admin/drain", None)
        )
        self.assertEqual(
            _request(_parser().parse_args(["drain", "--off"])),
            ("DELETE", "/admin/drain", None),
        )


class DrainStateTests(SynchronousTestCase):
    def test_persisted_until_undone(self) -> None:
        state_dir = self.mktemp()
        os.makedirs(state_dir)
        drain = DrainState(state_dir)
        told: list[bool] = []
        drain.subscribe(lambda: told.append(drain.draining))
        self.assertFalse(drain.draining)
        self.assertTrue(drain.set(True))
        self.assertFalse(drain.set(True))
        self.assertTrue(DrainState(state_dir).draining)
        drain.set(False)
        self.assertFalse(DrainState(state_dir).draining)
        self.assertEqual(told, [True, False])

    def test_unreadable_is_not_draining(self) -> None:
        state_dir = self.mktemp()
        os.makedirs(state_dir)
        with open(os.path.join(state_dir, "drain.json"), "w") as f:
            f.write("{nope")
        self.assertFalse(DrainState(state_dir).draining)


# -- three nodes over pinned mTLS ---------------------------------------------

NODES = ("node-a", "node-b", "node-c")
MODEL = "Qwen3-8B"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def served(fake: FakeVLLM) -> int:
    """Inference requests a fake engine answered."""
    return len([p for _, _, p in fake.calls if p.startswith("/v1/chat")])


class FleetTests(ProxyTestCase):
    async def fleet(
        self, hold: float = 5.0, **dispatch: Any
    ) -> tuple[dict[str, NvProxy], dict[str, FakeVLLM]]:
        """
        Three nodes, each with a vLLM service C{m} serving L{MODEL}, held
        for C{hold} seconds while it wakes, with C{dispatch} overrides.
        """
        root = os.path.abspath(self.mktemp())
        _, ports = pinned_cluster(root, NODES, reactor, engine="vllm")
        fakes: dict[str, FakeVLLM] = {}
        proxies: dict[str, NvProxy] = {}
        for node in NODES:
            fake = FakeVLLM(reactor, model=MODEL)
            fake.listen(reactor)
            self.addCleanup(fake.stop)
            config = proxy_config(
                os.path.join(root, node + "-state"),
                {"vllm": fake.url},
                admin=True,
                **dispatch,
            )
            engines = dict(config.engines)
            engines["vllm"] = evolve(
                engines["vllm"],
                port=ports[node],
                services=(VllmServiceConfig("m", fake.url, MODEL),),
                hold=VllmHold(sleeping=hold, offloaded=hold, restarting=hold),
            )
            config = evolve(
                config,
                node_id=node,
                cluster_dir=os.path.join(root, node),
                engines=engines,
            )
            proxy = await start_proxy(reactor, config)
            self.addCleanup(proxy.stopService)
            fakes[node], proxies[node] = fake, proxy
        for proxy in proxies.values():
            await self.settled(proxy)
        for fake in fakes.values():
            del fake.calls[:]
        return proxies, fakes

    async def settled(self, proxy: NvProxy) -> None:
        """The startup look is done and every peer's record was read."""
        assert proxy.vllm is not None and proxy.peer_records is not None
        for _ in range(300):
            if all(s["state"] != "unknown" for s in proxy.vllm.status()):
                break
            await deferLater(reactor, 0.01, lambda: None)
        await self.refresh(proxy)

    async def refresh(self, *proxies: NvProxy) -> None:
        """One record poll and one inventory poll of every given node."""
        for proxy in proxies:
            assert proxy.peer_records is not None
            await proxy.peer_records.poll()
            await proxy.polling.poll()

    async def asleep(self, proxy: NvProxy, level: int) -> None:
        assert proxy.vllm is not None
        await proxy.vllm.sleep("m", level)

    def readiness(self, at: NvProxy, node: str) -> str:
        entry = at.discovery.current.node("vllm", node)
        assert entry is not None
        return entry.readiness_of(MODEL).readiness

    async def chat(self, proxy: NvProxy, **extra: Any) -> tuple[int, Any, bytes]:
        return await self.post(
            facade_url(proxy, "vllm") + "/v1/chat/completions", {**CHAT, **extra}
        )

    async def test_awake_peer_before_local_sleeper(self) -> None:
        """
        Asleep on A, awake on B and C: a request at A goes to an awake peer
        and A's engine sees no wake call.
        """
        proxies, fakes = await self.fleet()
        a = proxies["node-a"]
        await self.asleep(a, 1)
        await self.refresh(a)
        self.assertEqual(self.readiness(a, "node-a"), "sleeping")
        code, _, body = await self.chat(a)
        self.assertEqual(code, 200, body)
        self.assertEqual(fakes["node-a"].wake_calls, 0)
        self.assertEqual(served(fakes["node-a"]), 0)
        self.assertEqual(served(fakes["node-b"]), 1)

    async def test_level_one_owner_woken(self) -> None:
        """
        Asleep everywhere, at level 2 on A and B and level 1 on C: a request
        at A wakes C only (before node records a peer counted as awake, so
        B was chosen and woken from level 2).
        """
        proxies, fakes = await self.fleet()
        for node, level in (("node-a", 2), ("node-b", 2), ("node-c", 1)):
            await self.asleep(proxies[node], level)
        a = proxies["node-a"]
        await self.refresh(a)
        self.assertEqual(
            [self.readiness(a, n) for n in NODES],
            ["offloaded", "offloaded", "sleeping"],
        )
        code, _, body = await self.chat(a)
        self.assertEqual(code, 200, body)
        self.assertEqual([fakes[n].wake_calls > 0 for n in NODES], [False, False, True])
        self.assertEqual(served(fakes["node-c"]), 1)

    async def test_peer_sleep_shows_at_next_poll(self) -> None:
        """
        B goes to sleep: B's record generation bumps and A's snapshot shows
        it after A's next record poll.
        """
        proxies, _ = await self.fleet()
        a, b = proxies["node-a"], proxies["node-b"]
        before = b.record.current().generation
        self.assertEqual(self.readiness(a, "node-b"), "awake")
        await self.asleep(b, 1)
        await deferLater(reactor, 0, lambda: None)
        record = b.record.current()
        self.assertGreater(record.generation, before)
        self.assertEqual(record.engines["vllm"].models[MODEL].readiness, "sleeping")
        assert a.peer_records is not None
        await a.peer_records.poll()
        self.assertEqual(self.readiness(a, "node-b"), "sleeping")
        code, _, body = await self.client.request(
            "GET", f"http://127.0.0.1:{a.admin.bound_port()}/admin/status"
        )
        records = json.loads(body)["records"]
        self.assertEqual([r["node"] for r in records], list(NODES))
        self.assertEqual(
            records[1]["engines"]["vllm"]["models"][MODEL]["readiness"], "sleeping"
        )

    async def test_drain(self) -> None:
        """
        Drain on B (A asleep, B and C awake): B's in-flight stream from A
        finishes; A's new requests go to C, not B; B's own local client is
        served elsewhere; B's status and record say draining.
        """
        proxies, fakes = await self.fleet()
        a, b = proxies["node-a"], proxies["node-b"]
        await self.asleep(a, 1)
        await self.refresh(a)
        fakes["node-b"].chunk_interval = 0.05
        stream: Deferred[tuple[int, Any, bytes]] = Deferred.fromCoroutine(
            self.chat(a, stream=True)
        )
        for _ in range(200):
            if fakes["node-b"].running:
                break
            await deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(fakes["node-b"].running, 1)
        code, _, body = await self.client.request(
            "POST", f"http://127.0.0.1:{b.admin.bound_port()}/admin/drain"
        )
        self.assertEqual((code, json.loads(body)["draining"]), (200, True))
        await self.refresh(a, b)
        self.assertTrue(a.discovery.current.node("vllm", "node-b").draining)  # type: ignore[union-attr]
        for _ in range(3):
            code, _, body = await self.chat(a)
            self.assertEqual(code, 200, body)
        self.assertEqual(served(fakes["node-b"]), 1)  # the stream only
        self.assertEqual(served(fakes["node-c"]), 3)
        code, _, body = await stream
        self.assertEqual(code, 200)
        self.assertIn(b"[DONE]", body)
        code, _, body = await self.chat(b)
        self.assertEqual(code, 200, body)
        self.assertEqual(served(fakes["node-b"]), 1)
        self.assertEqual(served(fakes["node-c"]), 4)
        status = b.ops.status()
        self.assertTrue(status["draining"])
        self.assertTrue(status["records"][0]["draining"])
        # persisted, and undone
        self.assertTrue(DrainState(b.config.state_dir).draining)
        code, out = await nvproxyctl(
            f"127.0.0.1:{b.admin.bound_port()}", "--json", "drain", "--off"
        )
        self.assertEqual(code, 0, out)
        self.assertFalse(json.loads(out)["draining"])
        self.assertFalse(DrainState(b.config.state_dir).draining)
        self.assertFalse(b.ops.status()["draining"])

    async def test_peer_503_passed_through(self) -> None:
        """
        Asleep everywhere and slow to wake: A's own hold passes (retryable
        elsewhere), then B holds the request and its depth-aware 503 is the
        final answer, passed through unchanged.
        """
        proxies, fakes = await self.fleet(hold=0.3, max_attempts=2, backoff=(0.01,))
        for node in NODES:
            fakes[node].wake_latency = 30.0
            await self.asleep(proxies[node], 1)
        a = proxies["node-a"]
        await self.refresh(a)
        code, headers, body = await self.chat(a)
        self.assertEqual(code, 503, body)
        error = json.loads(body)["error"]
        self.assertEqual(error["code"], "model_waking")
        self.assertEqual(error["sleep_depth"], "sleeping")
        self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"10"])
        self.assertEqual([fakes[n].wake_calls > 0 for n in NODES], [True, True, False])

    async def test_node_route_in_peer_mode_only(self) -> None:
        """
        C{GET /_nvproxy/node} answers a pinned peer (however the path is
        spelled); a plaintext client gets the facade's 404.
        """
        proxies, _ = await self.fleet()
        a, c = proxies["node-a"], proxies["node-c"]
        port = c.listeners["vllm"].bound_port()
        for path in ("/_nvproxy/node", "/_NVPROXY/./node", "/%5Fnvproxy//node"):
            code, _, body = await self.client.request(
                "GET", f"http://127.0.0.1:{port}{path}"
            )
            self.assertEqual(code, 404, path)
        state_a = a.cluster.current  # type: ignore[union-attr]
        pool = HTTPConnectionPool(reactor, persistent=False)
        agent = Agent(
            reactor, contextFactory=PeerPolicyForHTTPS(lambda: state_a), pool=pool
        )
        import treq

        for path in (b"/_nvproxy/node", b"/_NVPROXY/./node", b"/%5Fnvproxy//node"):
            response = await agent.request(
                b"GET", b"https://127.0.0.1:%d%s" % (port, path), Headers({})
            )
            record = json.loads(await treq.content(response))
            self.assertEqual(response.code, 200, path)
            self.assertEqual(record["node"], "node-c")
            self.assertEqual(record["version"], 1)
            self.assertEqual(
                record["engines"]["vllm"]["models"][MODEL]["readiness"], "awake"
            )
