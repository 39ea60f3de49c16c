# -*- test-case-name: tests.test_forwarding -*-
"""
Running a whole nvproxy in-process, for integration tests and benchmarks:
free ports, a config built from a few keyword arguments, a client that
leaves no connection behind, bounded waits for a condition or a health
check, and L{MemoryNetwork}, a reactor with simulated time and in-memory TCP
on which the same nvproxy runs without a socket.
"""

from __future__ import annotations

import errno
import io
import os
import socket
import sys
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

import treq
from attrs import evolve, fields_dict
from treq.client import HTTPClient
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import (
    CannotListenError,
    ConnectionAborted,
    ConnectionDone,
    ConnectionLost,
    ConnectionRefusedError,
    UserError,
)
from twisted.internet.interfaces import (
    IConnector,
    IDelayedCall,
    IListeningPort,
    IProtocol,
    IProtocolFactory,
    IPullProducer,
    IPushProducer,
    IReactorTCP,
    IReactorTime,
    IStreamClientEndpoint,
    ITCPTransport,
)
from twisted.internet.protocol import ClientFactory
from twisted.internet.task import Clock, Cooperator, deferLater
from twisted.internet.utils import getProcessOutputAndValue
from twisted.python.failure import Failure
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

from nvproxy.cluster import ClusterDir, Peer
from nvproxy.config import Config, DispatchConfig, load_config
from nvproxy.dispatch import DispatchPolicy
from nvproxy.service import NvProxy, build

_T = TypeVar("_T")


def free_port(interface: str = "127.0.0.1") -> int:
    """
    A TCP port that was free a moment ago (bind to 0, read it, release it).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((interface, 0))
        return int(s.getsockname()[1])


def proxy_config(
    state_dir: str,
    backends: Mapping[str, str],
    *,
    nodes: Mapping[str, Mapping[str, str]] | None = None,
    poll_interval: float = 0.05,
    admin: bool = False,
    port: Callable[[], int] = free_port,
    **dispatch: Any,
) -> Config:
    """
    A config enabling only the engines in C{backends} (engine -> this node's
    engine URL) on free ports, with fast polling.

    @param nodes: direct nodes, node id -> engine -> URL.
    @param port: picks each listening port (L{MemoryNetwork.free_port} for
        an in-memory proxy).
    @param dispatch: overrides of L{nvproxy.config.DispatchConfig} fields
        and of its L{nvproxy.dispatch.DispatchPolicy}'s.
    """
    base = load_config(
        None, {"state-dir": state_dir, "node-id": "local"}, {"HOME": state_dir}
    )
    engines = {}
    for engine_id, engine in base.engines.items():
        if engine_id in backends:
            engines[engine_id] = evolve(
                engine,
                enabled=True,
                port=port(),
                backend=backends[engine_id],
                backend_configured=True,
            )
        else:
            engines[engine_id] = evolve(engine, enabled=False)
    from nvproxy.config import NodeConfig

    return evolve(
        base,
        engines=engines,
        admin_enabled=admin,
        admin_listen=("127.0.0.1", port()),
        discovery_poll_interval=poll_interval,
        dispatch=_dispatch(base.dispatch, dispatch),
        nodes=tuple(
            NodeConfig(node_id, dict(urls)) for node_id, urls in (nodes or {}).items()
        ),
    )


def _dispatch(base: DispatchConfig, changes: Mapping[str, Any]) -> DispatchConfig:
    bounds = {k: v for k, v in changes.items() if k in fields_dict(DispatchPolicy)}
    rest = {k: v for k, v in changes.items() if k not in bounds}
    return evolve(base, policy=evolve(base.policy, **bounds), **rest)


async def start_proxy(reactor: Any, config: Config) -> NvProxy:
    """
    Build and start nvproxy; returns once every listener tried to bind and
    the first inventory poll finished.
    """
    proxy = build(config, reactor, hostname="local")
    proxy.startService()
    await proxy.ready()
    await proxy.polling.poll()
    return proxy


def pinned_cluster(
    root: str,
    nodes: Sequence[str],
    clock: IReactorTime,
    *,
    engine: str | None = None,
    address: str = "127.0.0.1",
) -> tuple[dict[str, ClusterDir], dict[str, int]]:
    """
    One cluster dir per node under C{root}, each with its identity and
    every other node pinned at C{address}, with a free facade port for
    C{engine} (no port when C{engine} is None: discovery says where).

    @return: the dirs and the ports, by node id.
    """
    dirs = {n: ClusterDir(os.path.join(root, n)) for n in nodes}
    fingerprints = {n: dirs[n].init(n, clock).fingerprint for n in nodes}
    ports = {n: free_port() for n in nodes}
    for node in nodes:
        for other in nodes:
            if other != node:
                facade = {} if engine is None else {engine: ports[other]}
                dirs[node].add_peer(Peer(other, address, fingerprints[other], facade))
    return dirs, ports


def facade_url(proxy: NvProxy, engine: str) -> str:
    port = proxy.listeners[engine].bound_port()
    return f"http://127.0.0.1:{port}"


class Client:
    """
    A treq client on its own pool, closed by L{close} so trial's reactor
    stays clean.
    """

    def __init__(self, reactor: Any, persistent: bool = True) -> None:
        self.pool = HTTPConnectionPool(reactor, persistent=persistent)
        if isinstance(reactor, MemoryNetwork):
            # No name resolution in memory (URLs name IP literals), and
            # request bodies are produced on the simulated clock, not by
            # the global reactor's cooperator.
            agent = Agent.usingEndpointFactory(
                reactor, _Endpoints(reactor), pool=self.pool
            )
            self.http = HTTPClient(agent, data_to_body_producer=reactor.body)
        else:
            self.http = HTTPClient(Agent(reactor, pool=self.pool))

    async def request(
        self, method: str, url: str, **kwargs: Any
    ) -> tuple[int, Any, bytes]:
        response = await self.http.request(method, url, **kwargs)
        body = await treq.content(response)
        return response.code, response.headers, body

    def close(self) -> Deferred[None]:
        closed: Deferred[None] = self.pool.closeCachedConnections()
        return closed


# -- bounded waits -------------------------------------------------------------


async def eventually(
    reactor: Any,
    condition: Callable[[], object],
    *,
    attempts: int = 200,
    interval: float = 0.01,
    what: str = "the condition",
) -> None:
    """
    Wait until C{condition()} is true: check it, then wait C{interval}
    seconds, at most C{attempts} times.  For what real sockets decide (a
    kernel buffer filling, a connection closing); where a L{Clock} can be
    moved instead, move it.

    @raise AssertionError: it never held.
    """
    for _ in range(attempts):
        if condition():
            return
        await deferLater(reactor, interval, lambda: None)
    if condition():
        return
    raise AssertionError(f"{what} did not hold within {attempts * interval:.2f} s")


class NotHealthy(Exception):
    """
    L{wait_healthy} gave up.

    @ivar exited: the process ended (else the time ran out).
    @ivar last: the last answer or error seen, for the message.
    """

    def __init__(self, url: str, exited: bool, within: float, last: object) -> None:
        self.url = url
        self.exited = exited
        self.last = last
        why = "exited" if exited else f"not healthy after {within} s"
        super().__init__(f"{url}: {why} (last: {last!r})")


def _answers_200(code: int, body: bytes) -> bool:
    return code == 200


async def wait_healthy(
    reactor: Any,
    url: str,
    *,
    within: float,
    interval: float = 0.1,
    alive: Callable[[], bool] = lambda: True,
    healthy: Callable[[int, bytes], bool] = _answers_200,
    request_timeout: float = 2.0,
) -> float:
    """
    Poll C{GET url} until C{healthy(code, body)} (by default: a 200), for a
    server a test started as a process; at most C{within} seconds, every
    C{interval}, each request at most C{request_timeout}.  A refused or
    failing request is "not yet".  Returns the seconds it took.

    @param alive: whether the process still runs; once it is not, waiting
        stops at once.
    @raise NotHealthy: the process exited or the time ran out.
    """
    client = Client(reactor, persistent=False)
    started = reactor.seconds()
    last: object = None
    try:
        while True:
            if not alive():
                raise NotHealthy(url, True, within, last)
            if reactor.seconds() - started > within:
                raise NotHealthy(url, False, within, last)
            try:
                d = client.http.get(url)
                d.addTimeout(request_timeout, reactor)
                response = await d
                body = await treq.content(response)
            except Exception as e:
                last = e  # not listening yet, or still loading
            else:
                last = (response.code, body[:200])
                if healthy(response.code, body):
                    return float(reactor.seconds() - started)
            await deferLater(reactor, interval, lambda: None)
    finally:
        await client.close()


async def nvproxyctl(admin: str, *argv: str) -> tuple[int, str]:
    """
    Run C{nvproxyctl --admin ADMIN ARGV...} as a subprocess (the console
    script's module, with this interpreter and environment); returns its
    exit code and its stdout and stderr together.

    @param admin: the admin API's C{host:port}.
    """
    out, err, code = await getProcessOutputAndValue(
        sys.executable,
        ["-m", "nvproxy.ctl", "--admin", admin, *argv],
        env=dict(os.environ),
    )
    return int(code), (out + err).decode()


# -- an in-memory network on simulated time ----------------------------------


@implementer(ITCPTransport, IPushProducer)
class _MemoryTransport:
    """
    One end of an in-memory TCP connection.  Bytes written reach the other
    end on a later turn of the clock (C{callLater(0)}), as on a real reactor;
    C{pauseProducing} stops delivery to this end until C{resumeProducing}.
    A registered producer is paused while more than L{high_water} bytes wait
    for a paused reader, so backpressure works end to end.
    """

    high_water = 64 * 1024

    def __init__(
        self,
        network: MemoryNetwork,
        protocol: IProtocol,
        host: IPv4Address,
        peer: IPv4Address,
    ) -> None:
        self._network = network
        self.protocol = protocol
        self._host = host
        self._peer = peer
        self.other: _MemoryTransport | None = None
        self.disconnecting = False
        self.disconnected = False
        self._aborting = False
        self._outgoing: list[bytes] = []
        self._reading_paused = False
        self._producer: IPushProducer | IPullProducer | None = None
        self._streaming = False
        self._producer_paused = False
        self._flush_call: IDelayedCall | None = None
        self._no_delay = False
        self._keep_alive = False

    # -- ITransport ------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.disconnecting or self.disconnected or not data:
            return
        self._outgoing.append(bytes(data))
        self._schedule()
        self._throttle()

    def writeSequence(self, data: Iterable[bytes]) -> None:
        self.write(b"".join(data))

    def loseConnection(self) -> None:
        """Close once every byte already written has been delivered."""
        if self.disconnecting or self.disconnected:
            return
        self.disconnecting = True
        self._schedule()

    def abortConnection(self) -> None:
        """Close now; what was not delivered is lost."""
        if self.disconnected:
            return
        self._outgoing.clear()
        self.disconnecting = self._aborting = True
        self._network.callLater(0, self._close, ConnectionAborted(), ConnectionLost())

    def loseWriteConnection(self) -> None:
        self.loseConnection()

    def getPeer(self) -> IPv4Address:
        return self._peer

    def getHost(self) -> IPv4Address:
        return self._host

    def setTcpNoDelay(self, enabled: bool) -> None:
        self._no_delay = bool(enabled)

    def getTcpNoDelay(self) -> bool:
        return self._no_delay

    def setTcpKeepAlive(self, enabled: bool) -> None:
        self._keep_alive = bool(enabled)

    def getTcpKeepAlive(self) -> bool:
        return self._keep_alive

    # -- IConsumer -------------------------------------------------------------

    def registerProducer(
        self, producer: IPushProducer | IPullProducer, streaming: bool
    ) -> None:
        if self.disconnected:
            producer.stopProducing()
            return
        self._producer = producer
        self._streaming = bool(streaming)
        self._producer_paused = False
        if not streaming:
            self._network.callLater(0, self._pull)
        self._throttle()

    def unregisterProducer(self) -> None:
        self._producer = None
        self._producer_paused = False

    # -- IPushProducer (this end's reading) ------------------------------------

    def pauseProducing(self) -> None:
        self._reading_paused = True

    def resumeProducing(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            if self.other is not None:
                self.other._schedule()

    def stopProducing(self) -> None:
        self.loseConnection()

    # -- delivery --------------------------------------------------------------

    def _pending(self) -> int:
        return sum(len(chunk) for chunk in self._outgoing)

    def _throttle(self) -> None:
        producer = self._producer
        if producer is None or not self._streaming:
            return
        if not self._producer_paused and self._pending() > self.high_water:
            self._producer_paused = True
            cast(IPushProducer, producer).pauseProducing()
        elif self._producer_paused and self._pending() <= self.high_water // 2:
            self._producer_paused = False
            cast(IPushProducer, producer).resumeProducing()

    def _pull(self) -> None:
        # A pull producer is asked for more when it registers and each time
        # what it wrote has been delivered (not in a loop at one instant:
        # simulated time would never move on).
        producer = self._producer
        if producer is None or self._streaming or self.disconnected:
            return
        producer.resumeProducing()

    def _schedule(self) -> None:
        if self._flush_call is None and not self.disconnected:
            self._flush_call = self._network.callLater(0, self._flush)

    def _flush(self) -> None:
        self._flush_call = None
        other = self.other
        if self.disconnected or other is None:
            return
        while self._outgoing and not other._reading_paused and not other.disconnected:
            chunk = self._outgoing.pop(0)
            other.protocol.dataReceived(chunk)
            if self.disconnected:
                return
        self._throttle()
        if self._aborting:
            return
        if self.disconnecting and not self._outgoing:
            self._close(ConnectionDone(), ConnectionDone())
        elif not self._outgoing and self._producer is not None and not self._streaming:
            self._network.callLater(0, self._pull)

    def _close(self, mine: Exception, theirs: Exception) -> None:
        other = self.other
        if self.disconnected:
            return
        self.disconnected = True
        self._network._connections.discard(self)
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.stopProducing()
        if other is not None and not other.disconnected:
            other.disconnected = other.disconnecting = True
            self._network._connections.discard(other)
            other_producer, other._producer = other._producer, None
            if other_producer is not None:
                other_producer.stopProducing()
            other.protocol.connectionLost(Failure(theirs))
        self.protocol.connectionLost(Failure(mine))


@implementer(IListeningPort)
class _MemoryPort:
    def __init__(
        self, network: MemoryNetwork, address: IPv4Address, factory: IProtocolFactory
    ) -> None:
        self._network = network
        self._address = address
        self.factory = factory

    def startListening(self) -> None:
        pass

    def stopListening(self) -> None:
        if self._network._ports.get(self._address.port) is self:
            del self._network._ports[self._address.port]
            self.factory.doStop()

    def getHost(self) -> IPv4Address:
        return self._address


@implementer(IConnector)
class _MemoryConnector:
    def __init__(
        self, network: MemoryNetwork, host: str, port: int, factory: ClientFactory
    ) -> None:
        self._network = network
        self._destination = IPv4Address("TCP", host, port)
        self.factory = factory
        self._attempt: IDelayedCall | None = network.callLater(0, self._connect)
        self.transport: _MemoryTransport | None = None

    def _connect(self) -> None:
        self._attempt = None
        network = self._network
        port = network._ports.get(self._destination.port)
        if port is None:
            self.factory.clientConnectionFailed(
                self, Failure(ConnectionRefusedError(self._destination.host))
            )
            return
        local = IPv4Address("TCP", "127.0.0.1", network._allocate())
        remote = IPv4Address("TCP", self._destination.host, self._destination.port)
        server_protocol = port.factory.buildProtocol(local)
        client_protocol = self.factory.buildProtocol(remote)
        if server_protocol is None or client_protocol is None:
            self.factory.clientConnectionFailed(
                self, Failure(ConnectionRefusedError(self._destination.host))
            )
            return
        server = _MemoryTransport(network, server_protocol, remote, local)
        client = _MemoryTransport(network, client_protocol, local, remote)
        server.other, client.other = client, server
        network._connections.update((server, client))
        self.transport = client
        server_protocol.makeConnection(server)
        client_protocol.makeConnection(client)

    def stopConnecting(self) -> None:
        if self._attempt is not None:
            self._attempt.cancel()
            self._attempt = None
            self.factory.clientConnectionFailed(self, Failure(UserError()))

    def disconnect(self) -> None:
        if self._attempt is not None:
            self.stopConnecting()
        elif self.transport is not None:
            self.transport.loseConnection()

    def connect(self) -> None:
        raise NotImplementedError("an in-memory connector connects once")

    def getDestination(self) -> IPv4Address:
        return self._destination


@implementer(IReactorTCP)
class MemoryNetwork(Clock):
    """
    A reactor for tests: simulated time (a L{Clock}) and TCP in memory.
    L{listenTCP} and L{connectTCP} meet by port number, every connection is
    from C{127.0.0.1}, and nothing happens until the test moves the clock
    (L{Clock.advance}, L{run}, L{settle}).  A whole nvproxy with its fake
    engines runs on it, deterministically and without a socket.
    """

    def __init__(self, first_port: int = 20000) -> None:
        super().__init__()
        self._ports: dict[int, _MemoryPort] = {}
        self._next_port = first_port
        self._connections: set[_MemoryTransport] = set()
        self._cooperator = Cooperator(scheduler=lambda f: self.callLater(0, f))

    def free_port(self) -> int:
        """A port nothing listens on yet (for L{proxy_config})."""
        return self._allocate()

    def _allocate(self) -> int:
        while self._next_port in self._ports:
            self._next_port += 1
        port = self._next_port
        self._next_port += 1
        return port

    def listenTCP(
        self,
        port: int,
        factory: IProtocolFactory,
        backlog: int = 50,
        interface: str = "",
    ) -> IListeningPort:
        if port == 0:
            port = self._allocate()
        if port in self._ports:
            raise CannotListenError(
                interface, port, OSError(errno.EADDRINUSE, "in use")
            )
        listening = _MemoryPort(
            self, IPv4Address("TCP", interface or "0.0.0.0", port), factory
        )
        self._ports[port] = listening
        factory.doStart()
        return listening

    def connectTCP(
        self,
        host: str,
        port: int,
        factory: ClientFactory[Any],
        timeout: float = 30,
        bindAddress: tuple[str, int] | None = None,
    ) -> IConnector:
        connector = _MemoryConnector(self, host, port, factory)
        factory.doStart()
        factory.startedConnecting(connector)
        return connector

    def body(self, data: Any) -> IBodyProducer:
        """
        A request body producer for bytes or a file that runs on this clock
        (treq's default uses the global reactor's cooperator).
        """
        if isinstance(data, bytes):
            data = io.BytesIO(data)
        if hasattr(data, "read"):
            return FileBodyProducer(data, cooperator=self._cooperator)
        return IBodyProducer(data)

    @property
    def open_connections(self) -> int:
        """Connection ends not yet closed (two per connection)."""
        return len(self._connections)

    def settle(self) -> None:
        """Run everything due now, including what that schedules for now."""
        self.advance(0)

    def run(self, d: Deferred[_T], limit: float = 300.0) -> _T:
        """
        Move the clock from one scheduled call to the next until C{d} fires
        (at most C{limit} simulated seconds) and return its result; raise
        its failure, or L{AssertionError} if it never fires.
        """
        results: list[Any] = []
        d.addBoth(results.append)
        end = self.seconds() + limit
        self.settle()
        while not results:
            if not self.calls or self.calls[0].getTime() > end:
                raise AssertionError(f"not done after {limit} simulated seconds: {d!r}")
            self.advance(max(0.0, self.calls[0].getTime() - self.seconds()))
        result = results[0]
        if isinstance(result, Failure):
            result.raiseException()
        return cast(_T, result)

    def run_coroutine(
        self, coroutine: Coroutine[Any, Any, _T], limit: float = 300.0
    ) -> _T:
        """L{run} for a coroutine."""
        return self.run(Deferred.fromCoroutine(coroutine), limit)


class _Endpoints:
    """Plain TCP endpoints for a client that only dials IP literals."""

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        return TCP4ClientEndpoint(self._reactor, uri.host.decode("ascii"), uri.port)
