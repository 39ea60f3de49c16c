# -*- test-case-name: tests.test_fakevllm -*-
"""
A fake vLLM OpenAI-compatible server with the dev-mode sleep API.

It answers like ``python -m vllm.entrypoints.openai.api_server`` started with
``VLLM_SERVER_DEV_MODE=1`` (see ENGINES.md), runs on an injected clock, and
can be scripted to be slow, to fail, or to go down.  Use it in process through
:meth:`FakeVLLM.resource` (e.g. ``StubTreq(fake.resource())``) or on a real
loopback port with :meth:`FakeVLLM.listen`.

Engine states (``fake.state``)::

                  POST /sleep (no running requests, or mode=abort)
        AWAKE ──────────────────────────────────────────────► ASLEEP (level N)
          ▲  │ POST /sleep?mode=wait with running requests       │   ▲
          │  └──────────► DRAINING ── last request ends ────────►│   │ scripted
          │                                                      │   │ wake failure
          │                  POST /wake_up (all tags woken)      ▼   │
          └─────────────────────────────────────────────────── WAKING
    set_down() from any state ─► DOWN ─► set_up() ─► AWAKE (cold start)

Faithful details: ``/health`` is 200 while asleep (and 503 for
``health_delay`` seconds after a wake or ``set_up``); ``/is_sleeping`` stays
true until every tag (``weights``, ``kv_cache``) is awake; ``/sleep`` without
``mode=wait`` ends running requests with ``finish_reason: "abort"``; after a
level-2 sleep the weights are garbage until ``POST /collective_rpc
{"method": "reload_weights"}``.

Things a correct proxy never does are recorded in ``fake.violations``
(:class:`Violation`): an inference request reaching the engine while it is
asleep, waking or draining, before ``/health`` is ready again, or with
unreloaded weights, and a ``/sleep`` that aborts running requests.
Proxy tests assert ``fake.violations == []``.

The API facts nvproxy's driver relies on are one contract test mixin
(``tests/vllm_contract.py``), run against this fake in the default suite and
against a real vLLM in the opt-in one (``tox -e real-vllm``), so the two
cannot drift apart unnoticed.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Any, ClassVar, Final, Literal, Protocol, cast
from urllib.parse import parse_qs

import attrs
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.internet.interfaces import (
    IDelayedCall,
    IListeningPort,
    IReactorTCP,
    IReactorTime,
    ITCPTransport,
)
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import NOT_DONE_YET, Request, Site
from zope.interface import implementer

__all__ = [
    "ALL_TAGS",
    "REQUEST_WHILE_ASLEEP",
    "REQUEST_WHILE_NOT_READY",
    "REQUEST_WHILE_WAKING",
    "SLEEP_ABORTED_REQUESTS",
    "VLLM_VERSION",
    "WEIGHTS_NOT_RELOADED",
    "EngineState",
    "FakeVLLM",
    "Violation",
]

log = Logger()

VLLM_VERSION: Final = "0.32.0"
ALL_TAGS: Final = frozenset({"weights", "kv_cache"})

# Violation kinds.
REQUEST_WHILE_ASLEEP: Final = "request_while_asleep"
REQUEST_WHILE_WAKING: Final = "request_while_waking"
REQUEST_WHILE_NOT_READY: Final = "request_while_not_ready"
WEIGHTS_NOT_RELOADED: Final = "weights_not_reloaded"
SLEEP_ABORTED_REQUESTS: Final = "sleep_aborted_requests"

_INFERENCE_ROUTES: Final = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
    "/pooling": "pooling",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/v1/audio/transcriptions": "transcription",
}
_GENERATING: Final = frozenset({"chat", "completion"})

JSONObject = dict[str, Any]


class EngineState(enum.Enum):
    AWAKE = "awake"
    DRAINING = "draining"
    """``/sleep?mode=wait`` is waiting for running requests to end."""
    ASLEEP = "asleep"
    WAKING = "waking"
    DOWN = "down"


@attrs.frozen
class Violation:
    """Something a correct proxy must never make the engine see."""

    time: float
    kind: str
    method: str
    path: str
    detail: str = ""


@attrs.define(eq=False)
class _Exchange:
    """One request answered later; knows whether the client is still there."""

    request: Request
    gone: bool = False
    done: bool = False

    @classmethod
    def watch(cls, request: Request) -> _Exchange:
        exchange = cls(request)

        def lost(_: Failure) -> None:
            exchange.gone = True

        request.notifyFinish().addErrback(lost)
        return exchange

    @property
    def open(self) -> bool:
        return not (self.gone or self.done)

    @property
    def out(self) -> _Response:
        return cast(_Response, self.request)

    def header(self, name: bytes, value: bytes) -> None:
        if self.open:
            self.out.setHeader(name, value)

    def write(self, data: bytes) -> None:
        if self.open:
            self.out.write(data)

    def finish(self) -> None:
        if self.open:
            self.done = True
            self.out.finish()

    def respond(self, code: int, body: bytes, content_type: bytes) -> None:
        if self.open:
            self.out.setResponseCode(code)
            self.header(b"content-type", content_type)
            self.header(b"content-length", b"%d" % (len(body),))
            self.write(body)
            self.finish()

    def json(self, code: int, obj: object) -> None:
        self.respond(code, _dumps(obj), b"application/json")

    def drop(self) -> None:
        """Vanish like a crashed process: abort the connection."""
        if self.open:
            self.done = True
            transport = self.request.channel.transport
            if ITCPTransport.providedBy(transport):
                transport.abortConnection()
            elif transport is not None:
                transport.loseConnection()


@attrs.define(eq=False)
class _Work:
    """One inference request inside the engine (held, running, or done)."""

    exchange: _Exchange
    kind: str
    body: JSONObject
    number: int
    stream: bool
    pieces: tuple[str, ...]
    truncated: bool
    include_usage: bool
    emitted: list[str] = attrs.field(factory=list)
    timer: IDelayedCall | None = None
    started: bool = False
    finished: bool = False

    def cancel_timer(self) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None


@attrs.define(eq=False)
class _Wake:
    """A wake in progress: what it wakes, how it ends, who waits for it."""

    tags: frozenset[str]
    fail: bool
    waiters: list[_Exchange] = attrs.field(factory=list)
    idle: list[Deferred[None]] = attrs.field(factory=list)
    timer: IDelayedCall | None = None


class _Response(Protocol):
    """The typed part of twisted.web's (unannotated) request we use."""

    def setResponseCode(self, code: int, message: bytes | None = None) -> None: ...
    def setHeader(self, name: bytes, value: bytes) -> None: ...
    def write(self, data: bytes) -> None: ...
    def finish(self) -> None: ...


@implementer(IResource)
@attrs.define(eq=False)
class _Resource:
    """A leaf resource answering every path from the fake."""

    fake: FakeVLLM
    isLeaf: ClassVar[bool] = True

    def getChildWithDefault(self, name: bytes, request: IRequest) -> IResource:
        return self

    def putChild(self, path: bytes, child: IResource) -> None:
        raise NotImplementedError("the fake vLLM resource has no children")

    def render(self, request: IRequest) -> bytes | int:
        assert isinstance(request, Request)
        return self.fake._render(request)


@attrs.define(eq=False)
class FakeVLLM:
    """
    A scriptable in-memory vLLM server on an injected clock.

    Scripting knobs (all may be changed at any time):

    * ``wake_latency``: seconds from a ``/wake_up`` to the engine being awake;
      ``/wake_up`` answers then, or at once if ``wake_answers_early``
      (vLLM's old fire-and-forget behaviour).
    * ``wake_failures``: the next N wakes fail: 500 after ``wake_latency``,
      the engine stays asleep at the same level.
    * ``health_delay``: ``/health`` answers 503 for this long after a wake.
    * ``chunks``, ``first_chunk_latency``, ``chunk_interval``: what a
      generation produces and how fast (``max_tokens`` truncates the chunks
      with ``finish_reason: "length"``).
    * ``sleep_aborts_running``: ``/sleep`` without ``mode=wait`` ends running
      requests with ``finish_reason: "abort"`` (as vLLM does); if False it
      waits for them as with ``mode=wait``.  Either way a ``/sleep`` that
      finds running requests without ``mode=wait`` is a violation.
    * ``crash_on_request_while_asleep``: an inference request reaching a
      sleeping engine gets a 500 (the crash the proxy must prevent); if False
      it is held until the engine wakes (vLLM 0.32 on CPU) when
      ``hold_requests_while_asleep``, else answered 503 (vLLM's documented
      "model is sleeping").  The violation is recorded either way.
    * ``down_mode``: what ``set_down`` looks like: ``"refuse"`` (connections
      refused or dropped, a restarting container) or ``"503"``.
    * ``rpc_failures``: the next N ``POST /collective_rpc`` answer 500 (the
      weights stay unloaded); ``rpc_latency``: it answers after this long.
    * ``answer_instead``: control route path -> the status it answers
      instead of the real answer (``0``: the connection is dropped), e.g.
      ``{"/is_sleeping": 503}`` or ``{"/health": 0}``.
    * ``sleep_state_gauge``: ``/metrics`` has the ``vllm:engine_sleep_state``
      gauge (False: an older vLLM without it).
    * ``api_key``: every request must carry ``Authorization: Bearer KEY``
      (``vllm serve --api-key``), else it is answered 401.

    Sleeping or waking it behind a proxy's back (as ``vllmctl`` or a cron
    job on its own port would): call its ``/sleep`` and ``/wake_up`` routes
    directly, or :meth:`force_sleep` and :meth:`force_wake`.
    """

    clock: IReactorTime
    model: str = "fake-model"
    max_model_len: int = 4096
    wake_latency: float = 0.0
    wake_answers_early: bool = False
    wake_failures: int = 0
    health_delay: float = 0.0
    chunks: tuple[str, ...] = ("Hello", ",", " I", " am", " a", " fake", ".")
    first_chunk_latency: float = 0.0
    chunk_interval: float = 0.0
    sleep_aborts_running: bool = True
    crash_on_request_while_asleep: bool = True
    hold_requests_while_asleep: bool = True
    down_mode: Literal["refuse", "503"] = "refuse"
    rpc_failures: int = 0
    rpc_latency: float = 0.0
    answer_instead: dict[str, int] = attrs.field(factory=dict)
    sleep_state_gauge: bool = True
    api_key: str | None = None

    calls: list[tuple[float, str, str]] = attrs.field(factory=list, init=False)
    """Every request received: (clock time, method, path with query)."""
    violations: list[Violation] = attrs.field(factory=list, init=False)
    wake_sequences: int = attrs.field(default=0, init=False)
    """``/wake_up`` calls that found the engine fully asleep (a retry counts)."""
    wake_calls: int = attrs.field(default=0, init=False)

    _state: EngineState = attrs.field(default=EngineState.AWAKE, init=False)
    _level: int | None = attrs.field(default=None, init=False)
    _sleeping_tags: frozenset[str] = attrs.field(default=frozenset(), init=False)
    _weights_loaded: bool = attrs.field(default=True, init=False)
    _ready_at: float = attrs.field(default=float("-inf"), init=False)
    _wake: _Wake | None = attrs.field(default=None, init=False)
    _running: list[_Work] = attrs.field(factory=list, init=False)
    _held: list[_Work] = attrs.field(factory=list, init=False)
    _drained: list[Deferred[None]] = attrs.field(factory=list, init=False)
    _exchanges: list[_Exchange] = attrs.field(factory=list, init=False)
    _counter: int = attrs.field(default=0, init=False)
    _delayed: list[IDelayedCall] = attrs.field(factory=list, init=False)
    _resource: _Resource | None = attrs.field(default=None, init=False)
    _reactor: IReactorTCP | None = attrs.field(default=None, init=False)
    _port: IListeningPort | None = attrs.field(default=None, init=False)
    _port_number: int = attrs.field(default=0, init=False)
    _unlistening: Deferred[None] | None = attrs.field(default=None, init=False)

    # ------------------------------------------------------------ inspection

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def sleep_level(self) -> int | None:
        """The level of the current sleep (also while waking), else None."""
        return self._level

    @property
    def is_sleeping(self) -> bool:
        """What ``GET /is_sleeping`` answers."""
        return self._state in (EngineState.ASLEEP, EngineState.WAKING)

    @property
    def active(self) -> int:
        """Inference requests inside the engine: running plus held."""
        return len(self._running) + len(self._held)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def port(self) -> int:
        """The loopback port given by :meth:`listen`."""
        return self._port_number

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port_number}"

    # ------------------------------------------------------------- scripting

    def force_sleep(self, level: int = 1) -> None:
        """Put the engine to sleep now, as if it had been asleep all along."""
        self._enter_sleep(level)

    def force_wake(self) -> None:
        """
        Wake the engine now, weights reloaded, as a complete direct wake
        sequence would (``/wake_up`` then ``reload_weights``); requests held
        while it slept start.  A no-op unless it is asleep.

        @raise ValueError: a ``/wake_up`` is running (let it finish).
        """
        if self._wake is not None:
            raise ValueError("a wake is in progress")
        if self._state is not EngineState.ASLEEP:
            return
        self._state = EngineState.AWAKE
        self._level = None
        self._sleeping_tags = frozenset()
        self._weights_loaded = True
        self._ready_at = self.clock.seconds() + self.health_delay
        held, self._held = self._held, []
        for work in held:
            if not work.exchange.gone:
                self._start(work)

    def set_down(self) -> None:
        """The container died: drop everything in flight, answer nothing."""
        self._state = EngineState.DOWN
        self._drop_everything()
        if self.down_mode == "refuse" and self._port is not None:
            port, self._port = self._port, None
            stopped = port.stopListening()
            self._unlistening = stopped if stopped is not None else succeed(None)

    def set_up(self, ready_after: float = 0.0) -> Deferred[None]:
        """
        The container is back: awake (vLLM always boots awake), weights
        loaded, ``/health`` 503 for ``ready_after`` seconds.  The Deferred
        fires once the loopback port listens again (at once if it never
        stopped).
        """
        self._state = EngineState.AWAKE
        self._level = None
        self._sleeping_tags = frozenset()
        self._weights_loaded = True
        self._ready_at = self.clock.seconds() + ready_after
        unlistening, self._unlistening = self._unlistening, None
        if unlistening is None:
            return succeed(None)

        def relisten(_: object) -> None:
            if self._reactor is not None and self._port is None:
                self.listen(self._reactor, self._port_number)

        return unlistening.addCallback(relisten)

    # ------------------------------------------------------------- transport

    def resource(self) -> IResource:
        """The twisted.web resource serving every route."""
        if self._resource is None:
            self._resource = _Resource(self)
        return self._resource

    def listen(self, reactor: IReactorTCP, port: int = 0) -> int:
        """Listen on 127.0.0.1 (``port=0``: any free port); return the port."""
        site = Site(self.resource())
        site.noisy = False
        self._reactor = reactor
        self._port = reactor.listenTCP(
            port,
            site,  # type: ignore[arg-type]  # Site is an unparameterized factory
            interface="127.0.0.1",
        )
        address = self._port.getHost()
        assert isinstance(address, IPv4Address)
        self._port_number = address.port
        return self._port_number

    def stop(self) -> Deferred[None]:
        """Stop listening and cancel every timer; in-flight requests vanish."""
        port, self._port = self._port, None
        self._reactor = None
        self._drop_everything()
        waits = [d for d in (self._unlistening,) if d is not None]
        self._unlistening = None
        if port is not None:
            stopped = port.stopListening()
            if stopped is not None:
                waits.append(stopped)
        return gatherResults(waits).addCallback(lambda _: None)

    def _drop_everything(self) -> None:
        """Cancel every timer and abort every request still open."""
        wake, self._wake = self._wake, None
        if wake is not None and wake.timer is not None and wake.timer.active():
            wake.timer.cancel()
        delayed, self._delayed = self._delayed, []
        for call in delayed:
            if call.active():
                call.cancel()
        for work in [*self._running, *self._held]:
            work.cancel_timer()
            work.finished = True
        self._running.clear()
        self._held.clear()
        self._drained.clear()
        exchanges, self._exchanges = self._exchanges, []
        for exchange in exchanges:
            exchange.drop()

    # ---------------------------------------------------------------- routing

    def _render(self, request: Request) -> bytes | int:
        method = request.method.decode("ascii", "replace")
        uri = request.uri.decode("latin-1")
        self.calls.append((self.clock.seconds(), method, uri))
        exchange = _Exchange.watch(request)
        self._exchanges = [e for e in self._exchanges if e.open]
        self._exchanges.append(exchange)
        if self.api_key is not None:
            presented = request.requestHeaders.getRawHeaders(b"authorization", [b""])
            if presented[0] != b"Bearer " + self.api_key.encode():
                exchange.json(401, {"error": "Unauthorized"})
                return NOT_DONE_YET
        if self._state is EngineState.DOWN:
            if self.down_mode == "503":
                exchange.json(503, {"detail": "Service Unavailable"})
            else:
                exchange.drop()
            return NOT_DONE_YET
        path = request.path.decode("latin-1")
        kind = _INFERENCE_ROUTES.get(path)
        if kind is not None:
            if method != "POST":
                exchange.json(405, {"detail": "Method Not Allowed"})
            else:
                self._inference(exchange, kind)
            return NOT_DONE_YET
        routes = {
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/version": ("GET", self._version),
            "/metrics": ("GET", self._metrics),
            "/is_sleeping": ("GET", self._is_sleeping),
            "/sleep": ("POST", self._sleep),
            "/wake_up": ("POST", self._wake_up),
            "/collective_rpc": ("POST", self._collective_rpc),
            "/reset_prefix_cache": ("POST", self._reset_prefix_cache),
            "/reset_mm_cache": ("POST", self._empty_ok),
            "/reset_encoder_cache": ("POST", self._empty_ok),
        }
        route = routes.get(path)
        instead = self.answer_instead.get(path)
        if route is not None and instead is not None:
            if instead == 0:
                exchange.drop()
            else:
                exchange.json(instead, {"detail": f"scripted {instead}"})
        elif route is None:
            exchange.json(404, {"detail": "Not Found"})
        elif route[0] != method and not (route[0] == "GET" and method == "HEAD"):
            exchange.json(405, {"detail": "Method Not Allowed"})
        else:
            route[1](exchange)
        return NOT_DONE_YET

    def _violate(self, kind: str, exchange: _Exchange, detail: str = "") -> None:
        request = exchange.request
        violation = Violation(
            time=self.clock.seconds(),
            kind=kind,
            method=request.method.decode("ascii", "replace"),
            path=request.uri.decode("latin-1"),
            detail=detail,
        )
        self.violations.append(violation)
        log.warn(
            "fake vLLM violation {kind} on {method} {path} {detail}",
            kind=kind,
            method=violation.method,
            path=violation.path,
            detail=detail,
        )

    # ------------------------------------------------------------ simple GETs

    def _models(self, exchange: _Exchange) -> None:
        exchange.json(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": int(self.clock.seconds()),
                        "owned_by": "vllm",
                        "root": self.model,
                        "parent": None,
                        "max_model_len": self.max_model_len,
                        "permission": [],
                    }
                ],
            },
        )

    def _health(self, exchange: _Exchange) -> None:
        ready = self.clock.seconds() >= self._ready_at
        exchange.respond(200 if ready else 503, b"", b"application/json")

    def _version(self, exchange: _Exchange) -> None:
        exchange.json(200, {"version": VLLM_VERSION})

    def _is_sleeping(self, exchange: _Exchange) -> None:
        exchange.json(200, {"is_sleeping": self.is_sleeping})

    def _metrics(self, exchange: _Exchange) -> None:
        asleep = self.is_sleeping
        states = {
            "awake": 0.0 if asleep else 1.0,
            "weights_offloaded": 1.0 if asleep and self._level == 1 else 0.0,
            "discard_all": 1.0 if asleep and self._level == 2 else 0.0,
        }
        labels = f'engine="0",model_name="{self.model}"'
        gauge = [
            "# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means "
            "engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; "
            "discard_all = 1 means sleep level 2.",
            "# TYPE vllm:engine_sleep_state gauge",
            *(
                f'vllm:engine_sleep_state{{{labels},sleep_state="{name}"}} {value}'
                for name, value in states.items()
            ),
        ]
        lines = [
            *(gauge if self.sleep_state_gauge else []),
            "# HELP vllm:num_requests_running Number of requests in model "
            "execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(len(self._running))}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be "
            "processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(len(self._held))}",
        ]
        exchange.respond(
            200,
            ("\n".join(lines) + "\n").encode(),
            b"text/plain; version=0.0.4; charset=utf-8",
        )

    # ------------------------------------------------------------- dev API

    def _empty_ok(self, exchange: _Exchange) -> None:
        exchange.respond(200, b"", b"application/json")

    def _reset_prefix_cache(self, exchange: _Exchange) -> None:
        exchange.json(200, {"success": True})

    def _collective_rpc(self, exchange: _Exchange) -> None:
        body = _json_body(exchange.request)
        if body is None:
            exchange.json(400, {"detail": "JSON decode error"})
            return
        method = body.get("method")
        if method is None:
            exchange.json(400, {"detail": "Missing 'method' in request body"})
            return
        if self.rpc_latency > 0:
            self._delayed = [c for c in self._delayed if c.active()]
            call = self.clock.callLater(self.rpc_latency, self._rpc, exchange, method)
            self._delayed.append(call)
        else:
            self._rpc(exchange, method)

    def _rpc(self, exchange: _Exchange, method: object) -> None:
        if not exchange.open:
            return
        if self.rpc_failures > 0:
            self.rpc_failures -= 1
            exchange.json(
                500, _error("rpc failed (scripted)", "InternalServerError", 500)
            )
            return
        if method == "reload_weights" and "weights" not in self._sleeping_tags:
            self._weights_loaded = True
        exchange.json(200, {"results": [None]})

    def _sleep(self, exchange: _Exchange) -> None:
        query = _query(exchange.request)
        mode = query.get("mode", ["abort"])[-1]
        try:
            level = int(query.get("level", ["1"])[-1])
        except ValueError:
            level = -1
        if level not in (0, 1, 2) or mode not in ("abort", "wait", "keep"):
            exchange.json(400, {"detail": "invalid level or mode"})
            return

        def sleep(_: object) -> Deferred[None]:
            return self._begin_sleep(level, mode, exchange)

        def answer(_: object) -> None:
            exchange.json(200, {"status": "sleeping", "level": level})

        self._when_not_waking().addCallback(sleep).addCallback(answer)

    def _when_not_waking(self) -> Deferred[None]:
        """vLLM runs engine utility calls one at a time: wait out a wake."""
        if self._wake is None:
            return succeed(None)
        waiting: Deferred[None] = Deferred()
        self._wake.idle.append(waiting)
        return waiting

    def _begin_sleep(
        self, level: int, mode: str, exchange: _Exchange
    ) -> Deferred[None]:
        if self._state is EngineState.DOWN:
            return Deferred()  # never answers; set_down dropped the client
        running = list(self._running)
        if running and mode == "abort":
            self._violate(SLEEP_ABORTED_REQUESTS, exchange, f"{len(running)} running")
            if self.sleep_aborts_running:
                for work in running:
                    self._complete(work, "abort")
        if self._running and self._state is EngineState.AWAKE:
            # mode=wait (and keep, treated alike), or aborts disabled
            self._state = EngineState.DRAINING
        if self._state is EngineState.DRAINING and self._running:
            drained: Deferred[None] = Deferred()
            self._drained.append(drained)
            return drained.addCallback(lambda _: self._enter_sleep(level))
        self._enter_sleep(level)
        return succeed(None)

    def _enter_sleep(self, level: int) -> None:
        if self.is_sleeping and self._level is not None:
            self._level = max(self._level, level)
        else:
            self._level = level
        self._state = EngineState.ASLEEP
        self._sleeping_tags = ALL_TAGS
        if self._level == 2:
            self._weights_loaded = False

    def _check_drained(self) -> None:
        if self._running or self._state is not EngineState.DRAINING:
            return
        drained, self._drained = self._drained, []
        for d in drained:
            d.callback(None)

    def _wake_body(self) -> bytes:
        # vLLM 0.32 answers /wake_up with the state after the call:
        # {"status": "awake", "tags": null} or, after a partial wake,
        # {"status": "sleeping", "tags": [the tags still asleep]}.
        if self._state is EngineState.AWAKE or not self._sleeping_tags:
            return b'{"status":"awake","tags":null}'
        tags = json.dumps(sorted(self._sleeping_tags))
        return b'{"status":"sleeping","tags":%s}' % tags.encode()

    def _wake_up(self, exchange: _Exchange) -> None:
        self.wake_calls += 1
        tags = frozenset(_query(exchange.request).get("tags", [])) or ALL_TAGS
        if self._wake is not None:
            # vLLM serializes wakes: answer when the running one ends
            if self.wake_answers_early:
                exchange.respond(200, self._wake_body(), b"application/json")
            else:
                self._wake.waiters.append(exchange)
            return
        if self._state is not EngineState.ASLEEP:
            exchange.respond(200, self._wake_body(), b"application/json")
            return
        if self._sleeping_tags == ALL_TAGS:
            self.wake_sequences += 1
        fail = self.wake_failures > 0
        if fail:
            self.wake_failures -= 1
        wake = _Wake(tags=tags & self._sleeping_tags, fail=fail)
        self._wake = wake
        self._state = EngineState.WAKING
        if self.wake_answers_early:
            exchange.respond(200, self._wake_body(), b"application/json")
        else:
            wake.waiters.append(exchange)
        if self.wake_latency > 0:
            wake.timer = self.clock.callLater(self.wake_latency, self._finish_wake)
        else:
            self._finish_wake()

    def _finish_wake(self) -> None:
        wake, self._wake = self._wake, None
        if wake is None:
            return
        if wake.fail:
            self._state = EngineState.ASLEEP
            for exchange in wake.waiters:
                exchange.json(
                    500,
                    _error("wake_up failed (scripted)", "InternalServerError", 500),
                )
        else:
            self._sleeping_tags -= wake.tags
            if self._sleeping_tags:
                self._state = EngineState.ASLEEP
            else:
                self._state = EngineState.AWAKE
                self._level = None
                self._ready_at = self.clock.seconds() + self.health_delay
            body = self._wake_body()
            for exchange in wake.waiters:
                exchange.respond(200, body, b"application/json")
        for idle in wake.idle:
            idle.callback(None)
        if self._state is EngineState.AWAKE:
            held, self._held = self._held, []
            for work in held:
                if not work.exchange.gone:
                    self._start(work)

    # -------------------------------------------------------------- inference

    def _inference(self, exchange: _Exchange, kind: str) -> None:
        request = exchange.request
        body: JSONObject | None
        if kind == "transcription":
            model = _multipart_field(request, b"model")
            body = {} if model is None else {"model": model}
        else:
            body = _json_body(request)
        if body is None:
            exchange.json(400, _error("Invalid JSON body", "BadRequestError", 400))
            return
        model = body.get("model")
        if model is not None and model != self.model:
            exchange.json(
                404,
                _error(f"The model `{model}` does not exist.", "NotFoundError", 404),
            )
            return
        self._counter += 1
        work = self._make_work(exchange, kind, body)
        if self._state is not EngineState.AWAKE:
            waking = self._state is EngineState.WAKING
            self._violate(
                REQUEST_WHILE_WAKING if waking else REQUEST_WHILE_ASLEEP,
                exchange,
                self._state.value,
            )
            if self.crash_on_request_while_asleep:
                exchange.json(
                    500,
                    _error(
                        "EngineCore encountered an issue (request while asleep)",
                        "InternalServerError",
                        500,
                    ),
                )
            elif self.hold_requests_while_asleep:
                self._held.append(work)
                request.notifyFinish().addErrback(lambda _: self._forget(work))
            else:
                exchange.json(
                    503,
                    _error("The model is sleeping.", "ServiceUnavailableError", 503),
                )
            return
        if self.clock.seconds() < self._ready_at:
            self._violate(REQUEST_WHILE_NOT_READY, exchange)
        if not self._weights_loaded:
            self._violate(WEIGHTS_NOT_RELOADED, exchange)
        self._start(work)

    def _make_work(self, exchange: _Exchange, kind: str, body: JSONObject) -> _Work:
        pieces = self.chunks if kind in _GENERATING else ()
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        truncated = False
        if isinstance(max_tokens, int) and 0 <= max_tokens < len(pieces):
            pieces, truncated = pieces[:max_tokens], True
        options = body.get("stream_options")
        return _Work(
            exchange=exchange,
            kind=kind,
            body=body,
            number=self._counter,
            stream=kind in _GENERATING and body.get("stream") is True,
            pieces=pieces,
            truncated=truncated,
            include_usage=isinstance(options, dict)
            and options.get("include_usage") is True,
        )

    def _forget(self, work: _Work) -> None:
        """The client went away."""
        work.cancel_timer()
        work.finished = True
        if work in self._held:
            self._held.remove(work)
        if work in self._running:
            self._running.remove(work)
            self._check_drained()

    def _start(self, work: _Work) -> None:
        work.started = True
        self._running.append(work)
        if not work.exchange.gone:
            work.exchange.request.notifyFinish().addErrback(
                lambda _: self._forget(work)
            )
        self._schedule(work, self.first_chunk_latency)

    def _schedule(self, work: _Work, delay: float) -> None:
        if delay > 0:
            work.timer = self.clock.callLater(delay, self._step, work)
        else:
            self._step(work)

    def _step(self, work: _Work) -> None:
        work.timer = None
        if work.finished:
            return
        if len(work.emitted) < len(work.pieces):
            piece = work.pieces[len(work.emitted)]
            if work.stream:
                if not work.emitted:
                    work.exchange.header(
                        b"content-type", b"text/event-stream; charset=utf-8"
                    )
                    if work.kind == "chat":
                        self._sse(work, self._chunk(work, "", None, role=True))
                self._sse(work, self._chunk(work, piece, None))
            work.emitted.append(piece)
            if len(work.emitted) < len(work.pieces):
                self._schedule(work, self.chunk_interval)
                return
        self._complete(work, "length" if work.truncated else "stop")

    def _complete(self, work: _Work, finish_reason: str) -> None:
        """End ``work`` with ``finish_reason`` (``stop``, ``length``, ``abort``)."""
        if work.finished:
            return
        work.cancel_timer()
        work.finished = True
        if work in self._running:
            self._running.remove(work)
        exchange = work.exchange
        if work.stream:
            if not work.emitted:
                exchange.header(b"content-type", b"text/event-stream; charset=utf-8")
            self._sse(work, self._chunk(work, "", finish_reason))
            if work.include_usage:
                self._sse(work, self._usage_chunk(work))
            exchange.write(b"data: [DONE]\n\n")
            exchange.finish()
        else:
            exchange.json(200, self._final_body(work, finish_reason))
        self._check_drained()

    # --------------------------------------------------------------- payloads

    def _sse(self, work: _Work, obj: JSONObject) -> None:
        work.exchange.write(b"data: " + _dumps(obj) + b"\n\n")

    def _envelope(self, work: _Work, prefix: str, obj: str) -> JSONObject:
        return {
            "id": f"{prefix}-fake{work.number}",
            "object": obj,
            "created": int(self.clock.seconds()),
            "model": self.model,
        }

    def _usage(self, work: _Work) -> JSONObject:
        prompt = _prompt_tokens(work.body)
        completion = len(work.emitted)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        }

    def _chunk(
        self, work: _Work, text: str, finish_reason: str | None, role: bool = False
    ) -> JSONObject:
        if work.kind == "chat":
            delta: JSONObject = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice: JSONObject = {"index": 0, "delta": delta}
            head = self._envelope(work, "chatcmpl", "chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text}
            head = self._envelope(work, "cmpl", "text_completion")
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        return {**head, "choices": [choice]}

    def _usage_chunk(self, work: _Work) -> JSONObject:
        kind = "chat.completion.chunk" if work.kind == "chat" else "text_completion"
        prefix = "chatcmpl" if work.kind == "chat" else "cmpl"
        return {
            **self._envelope(work, prefix, kind),
            "choices": [],
            "usage": self._usage(work),
        }

    def _final_body(self, work: _Work, finish_reason: str) -> JSONObject:
        text = "".join(work.emitted)
        body = work.body
        if work.kind == "chat":
            return {
                **self._envelope(work, "chatcmpl", "chat.completion"),
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "tool_calls": [],
                        },
                        "logprobs": None,
                        "finish_reason": finish_reason,
                    }
                ],
                "usage": self._usage(work),
            }
        if work.kind == "completion":
            return {
                **self._envelope(work, "cmpl", "text_completion"),
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": finish_reason,
                    }
                ],
                "usage": self._usage(work),
            }
        tokens = _prompt_tokens(body)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        if work.kind == "embedding":
            inputs = _as_list(body.get("input"))
            return {
                **self._envelope(work, "embd", "list"),
                "data": [
                    {"index": i, "object": "embedding", "embedding": _vector(x)}
                    for i, x in enumerate(inputs)
                ],
                "usage": usage,
            }
        if work.kind == "pooling":
            inputs = _as_list(body.get("input"))
            return {
                **self._envelope(work, "pool", "list"),
                "data": [
                    {"index": i, "object": "pooling", "data": _vector(x)}
                    for i, x in enumerate(inputs)
                ],
                "usage": usage,
            }
        if work.kind == "score":
            query = str(body.get("text_1", body.get("queries", "")))
            docs = _as_list(body.get("text_2", body.get("documents")))
            return {
                **self._envelope(work, "score", "list"),
                "data": [
                    {"index": i, "object": "score", "score": _score(query, d)}
                    for i, d in enumerate(docs)
                ],
                "usage": usage,
            }
        if work.kind == "rerank":
            query = str(body.get("query", ""))
            docs = _as_list(body.get("documents"))
            ranked = sorted(enumerate(docs), key=lambda item: -_score(query, item[1]))
            results: list[JSONObject] = [
                {
                    "index": i,
                    "document": {"text": d},
                    "relevance_score": _score(query, d),
                }
                for i, d in ranked
            ]
            top_n = body.get("top_n")
            if isinstance(top_n, int) and top_n > 0:
                results = results[:top_n]
            return {
                "id": f"rerank-fake{work.number}",
                "model": self.model,
                "usage": {"total_tokens": tokens},
                "results": results,
            }
        return {"text": "".join(self.chunks)}


# ------------------------------------------------------------------ helpers


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _error(message: str, kind: str, code: int) -> JSONObject:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _query(request: Request) -> dict[str, list[str]]:
    _, _, query = request.uri.partition(b"?")
    return parse_qs(query.decode("latin-1"), keep_blank_values=True)


def _json_body(request: Request) -> JSONObject | None:
    content = request.content
    raw = content.read() if content is not None else b""
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _multipart_field(request: Request, name: bytes) -> str | None:
    """Read one small text field of a multipart body, ignoring the others."""
    content_type = request.getHeader(b"content-type") or b""
    match = re.search(rb'boundary="?([^";]+)"?', content_type)
    if match is None or request.content is None:
        return None
    request.content.seek(0)
    body: bytes = request.content.read()
    wanted = re.compile(
        rb'content-disposition:[^\r\n]*[;\s]name="?'
        + re.escape(name)
        + rb'"?(?:;|\s|$)',
        re.IGNORECASE | re.MULTILINE,
    )
    for part in body.split(b"--" + match.group(1))[1:]:
        if part.startswith(b"--"):
            break
        head, sep, value = part.partition(b"\r\n\r\n")
        if sep and wanted.search(head):
            return value.removesuffix(b"\r\n").decode("utf-8", "replace")
    return None


def _as_list(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, list):
        return [str(v) for v in value]
    return [str(value)]


def _prompt_tokens(body: JSONObject) -> int:
    texts: list[str] = []
    for key in ("prompt", "input", "query", "text_1", "text_2", "documents"):
        texts.extend(_as_list(body.get(key)))
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                texts.append(str(message.get("content", "")))
    return max(1, sum(len(t.split()) for t in texts))


def _vector(text: str) -> list[float]:
    return [round(((len(text) + 3 * i) % 11) / 10.0, 3) for i in range(8)]


def _score(query: str, doc: str) -> float:
    shared = set(query.lower().split()) & set(doc.lower().split())
    return round(len(shared) / (1 + len(set(doc.lower().split()))), 4)
