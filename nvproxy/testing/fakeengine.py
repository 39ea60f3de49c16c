# -*- test-case-name: tests.test_fakeengine -*-
"""
Fake LLM engines with scriptable faults, for tests and for manual poking.

A L{FakeEngine} speaks one dialect -- C{"ollama"}, C{"openai"} (LM Studio /
vLLM) or C{"llamacpp"} (C{llama-server}) -- over plain C{twisted.web}.  Each
request takes a L{Behaviour}: scripted ones first (per path, then the general
queue for inference routes), else L{FakeEngine.default} for inference routes
and a plain, healthy answer for everything else.  A behaviour plays out as::

    request read and recorded
      -- latency --> refuse?  (RST, no response)
                     stall_before_headers?  (hold until the client or stop())
                     status line + headers
      -- first_chunk_delay --> headers_then_silence?  (hold)
                     body part 0 -- chunk_interval --> part 1 ... (one HTTP
                     chunk each when streaming); die_after_chunks=N closes
                     the connection after N parts, without ending the body

All waits use the injected clock, so the in-memory L{FakeEngine.resource}
works under C{treq.testing.StubTreq} with C{task.Clock}.  L{FakeEngine.stop}
cancels every timer and drops every connection, held ones included.

Run as a program::

    python -m nvproxy.testing.fakeengine --dialect ollama --port 0 --models a,b

It prints C{listening on HOST:PORT} once ready and runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, cast, get_args

import attrs
from attrs import field, frozen, validators
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, fail, gatherResults, maybeDeferred, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import (
    IAddress,
    IDelayedCall,
    IListeningPort,
    IReactorCore,
    IReactorTCP,
    IReactorTime,
    ITCPTransport,
)
from twisted.internet.protocol import ServerFactory
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.web.http import Request as HTTPRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from nvproxy.testing import _fakedialects as dialects
from nvproxy.testing.fakecors import CorsPolicy

__all__ = ["Behaviour", "Dialect", "FakeEngine", "RecordedRequest", "main"]

Dialect = Literal["ollama", "openai", "llamacpp"]
DIALECTS: tuple[str, ...] = get_args(Dialect)


def _header_pairs(
    value: Mapping[str, str] | Iterable[tuple[str, str]],
) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple((str(k), str(v)) for k, v in items)


_seconds = validators.ge(0.0)


@frozen
class Behaviour:
    """
    How the engine answers one request.  Every field works on its own.

    @ivar status: a non-2xx status answers with the dialect's error body.
    @ivar latency: seconds before the status line (or before C{refuse}).
    @ivar chunks: tokens generated; a streaming answer writes one body part
        per token plus the dialect's opening and closing events.  The
        llama.cpp dialect treats it as where the model stops by itself and
        caps it at the request's token limit (C{n_predict}, C{max_tokens},
        ...); an answer cut short by that limit says so (C{finish_reason:
        "length"}, C{stop_type: "limit"}), as C{llama-server} does.
    @ivar chunk_interval: seconds between consecutive body parts.
    @ivar first_chunk_delay: seconds between the headers and the first part.
    @ivar report_usage: C{False} leaves out usage / eval counts / timings.
    @ivar always_stream_usage: send the OpenAI usage chunk in a stream even
        when the request did not ask for it with C{stream_options}.
    @ivar refuse: reset the connection (RST) without any response.
    @ivar stall_before_headers: never answer.
    @ivar headers_then_silence: send status and headers, then nothing.
    @ivar die_after_chunks: close the connection after this many body parts
        without finishing the body.  A non-streaming body counts as one part:
        0 dies right after the headers, 1 or more after half the body.
    @ivar body: the exact body to send instead of the dialect's one.
    @ivar headers: extra response headers (a mapping or name/value pairs);
        a name given here replaces the engine's own header of that name.
    @ivar retry_after: a C{Retry-After} header value in seconds.
    """

    status: int = 200
    latency: float = field(default=0.0, validator=_seconds)
    chunks: int = field(default=5, validator=validators.ge(0))
    chunk_interval: float = field(default=0.0, validator=_seconds)
    first_chunk_delay: float = field(default=0.0, validator=_seconds)
    report_usage: bool = True
    always_stream_usage: bool = False
    refuse: bool = False
    stall_before_headers: bool = False
    headers_then_silence: bool = False
    die_after_chunks: int | None = field(
        default=None, validator=validators.optional(validators.ge(0))
    )
    body: bytes | None = None
    headers: tuple[tuple[str, str], ...] = field(default=(), converter=_header_pairs)
    retry_after: int | None = None


@frozen
class RecordedRequest:
    """
    One request as the engine received it.

    @ivar headers: lower-cased names; repeated headers joined with C{", "}.
    @ivar raw_headers: every header as received (name case preserved).
    @ivar model: from the JSON body (C{model}, or C{name} for Ollama's pull
        and show) or the multipart C{model} field; C{None} if absent.
    @ivar at: the clock's C{seconds()} when the request was read.
    """

    method: str
    path: str
    uri: str
    headers: Mapping[str, str]
    raw_headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    model: str | None
    at: float
    peer: str | None
    behaviour: Behaviour

    def json(self) -> Any:
        return json.loads(self.body)


_PLAIN = Behaviour()


class _Exchange:
    """Plays one L{Behaviour} out on one request; owns its pending timer."""

    def __init__(
        self,
        engine: FakeEngine,
        request: Request,
        behaviour: Behaviour,
        reply: dialects.Reply,
    ) -> None:
        self._engine = engine
        self._request = request
        self._out = cast(_Writer, request)
        self._behaviour = behaviour
        self._reply = reply
        self._timer: IDelayedCall | None = None
        self._parts: tuple[bytes, ...] = ()
        self._sent = 0
        self.done = False

    def start(self) -> None:
        self._request.notifyFinish().addBoth(self._gone)
        self._after(self._behaviour.latency, self._respond)

    def cancel(self) -> None:
        """Drop the connection and any pending timer."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if not self.done:
            self._transport().abortConnection()

    def _transport(self) -> ITCPTransport:
        return cast(ITCPTransport, self._request.transport)

    def _gone(self, result: object) -> None:
        # Finished, or the connection went away: nothing more to do.
        self.done = True
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self._engine._exchanges.discard(self)

    def _after(self, delay: float, action: Callable[[], None]) -> None:
        if self.done:
            return
        if delay > 0:
            self._timer = self._engine.clock.callLater(delay, self._fire, action)
        else:
            action()

    def _fire(self, action: Callable[[], None]) -> None:
        self._timer = None
        action()

    def _respond(self) -> None:
        b, request, reply = self._behaviour, self._request, self._reply
        if b.refuse:
            self._transport().abortConnection()
            return
        if b.stall_before_headers:
            return
        if b.body is not None:
            status = reply.status if b.status == 200 else b.status
            reply = attrs.evolve(reply, status=status, parts=(b.body,))
        elif b.status != 200 and reply.status == 200 and b.status < 300:
            reply = attrs.evolve(reply, status=b.status)
        elif b.status >= 300:
            reply = dialects.error_reply(
                self._engine._family(request),
                b.status,
                f"fake engine: scripted status {b.status}",
            )
        parts = reply.parts
        out = self._out
        out.setResponseCode(reply.status)
        out.setHeader(b"Content-Type", reply.content_type.encode("ascii"))
        if not reply.streaming:
            out.setHeader(b"Content-Length", b"%d" % len(parts[0]))
            if b.die_after_chunks:
                parts = (parts[0][: len(parts[0]) // 2],)
        if b.retry_after is not None:
            out.setHeader(b"Retry-After", str(b.retry_after).encode("ascii"))
        extra: dict[str, list[str]] = {}
        for name, value in b.headers:
            extra.setdefault(name.lower(), []).append(value)
        for name, values in extra.items():  # replaces, e.g. Content-Type
            request.responseHeaders.setRawHeaders(name, values)
        self._engine._cors_headers(request)
        self._parts = parts
        if b.headers_then_silence or b.first_chunk_delay > 0:
            out.write(b"")  # flushes the status line and headers
        if not b.headers_then_silence:
            self._after(b.first_chunk_delay, self._write_parts)

    def _write_parts(self) -> None:
        b, parts = self._behaviour, self._parts
        for _ in range(len(parts) + 1):
            if self.done:
                return
            if b.die_after_chunks is not None and self._sent >= min(
                b.die_after_chunks, len(parts)
            ):
                self._out.write(b"")
                self._transport().loseConnection()
                return
            if self._sent == len(parts):
                self._out.finish()
                return
            self._out.write(parts[self._sent])
            self._sent += 1
            if self._sent < len(parts) and b.chunk_interval > 0:
                self._after(b.chunk_interval, self._write_parts)
                return


class _EngineResource(Resource):
    isLeaf = True

    def __init__(self, engine: FakeEngine) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._engine = engine

    def render(self, request: Request) -> int:
        self._engine._handle(request)
        return NOT_DONE_YET


class _QuietSite(Site):
    noisy = False

    def log(self, request: HTTPRequest) -> None:
        """No access log."""


class _TrackingFactory(WrappingFactory[ProtocolWrapper]):
    """Keeps every live connection, so L{FakeEngine.stop} can drop them."""

    noisy = False

    def __init__(self, site: Site) -> None:
        self.wrappedFactory = site
        self.protocols: dict[ProtocolWrapper, int] = {}
        self.waiting: dict[ProtocolWrapper, list[Deferred[None]]] = {}

    def unregisterProtocol(self, p: ProtocolWrapper) -> None:
        self.protocols.pop(p, None)
        for d in self.waiting.pop(p, []):
            d.callback(None)

    def drop_all(self) -> list[Deferred[None]]:
        """Abort every connection; the Deferreds fire as they are lost."""
        lost = []
        for p in list(self.protocols):
            d: Deferred[None] = Deferred()
            self.waiting.setdefault(p, []).append(d)
            lost.append(d)
            cast(ITCPTransport, p.transport).abortConnection()
        return lost


class _Writer(typing.Protocol):
    """The typed part of L{Request} an exchange uses."""

    def setResponseCode(self, code: int) -> None: ...
    def setHeader(self, name: bytes, value: bytes) -> None: ...
    def write(self, data: bytes) -> None: ...
    def finish(self) -> None: ...
    def getClientAddress(self) -> IAddress: ...


class FakeEngine:
    """
    A fake engine of one dialect.

    @ivar models: the advertised models; tests may change it at any time.
    @ivar default: the behaviour of inference requests when nothing is scripted.
    @ivar requests: every request received, in order.
    @ivar cors: the engine's CORS policy; L{None} (the default) sends no
        CORS header and treats a preflight as any other C{OPTIONS}.
    """

    def __init__(
        self,
        dialect: Dialect,
        models: Sequence[str],
        clock: IReactorTime,
    ) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r}; expected {DIALECTS}")
        self.dialect = dialect
        self.models: list[str] = list(models)
        self.clock = clock
        self.default = Behaviour()
        self.requests: list[RecordedRequest] = []
        self.cors: CorsPolicy | None = None
        self._routes = dialects.ROUTES[dialect]
        self._queue: deque[Behaviour] = deque()
        self._by_path: dict[str, deque[Behaviour]] = {}
        self._exchanges: set[_Exchange] = set()
        self._resource = _EngineResource(self)
        site = _QuietSite(self._resource, reactor=clock)  # type: ignore[no-untyped-call]
        self._factory = _TrackingFactory(site)
        self._listening: IListeningPort | None = None
        self._last_port = 0
        self._interface = "127.0.0.1"

    # -- scripting -----------------------------------------------------------

    def script(self, *behaviours: Behaviour, path: str | None = None) -> None:
        """
        Queue behaviours for the next inference requests, in order; with
        C{path}, for the next requests to exactly that path, whatever it is.
        """
        if path is None:
            self._queue.extend(behaviours)
        else:
            self._by_path.setdefault(path, deque()).extend(behaviours)

    @property
    def scripted(self) -> int:
        """How many scripted behaviours are still queued."""
        return len(self._queue) + sum(len(q) for q in self._by_path.values())

    @property
    def pending(self) -> int:
        """Requests received and not yet answered completely."""
        return len(self._exchanges)

    @property
    def pulls(self) -> list[str | None]:
        """The models asked for by C{POST /api/pull}, in order."""
        return [r.model for r in self.requests if r.path == "/api/pull"]

    # -- serving -------------------------------------------------------------

    def resource(self) -> IResource:
        """The engine as a resource (for C{StubTreq} or another C{Site})."""
        return self._resource

    def listen(
        self,
        reactor: IReactorTCP,
        port: int | None = None,
        interface: str = "127.0.0.1",
    ) -> Deferred[IListeningPort]:
        """
        Listen on C{interface}; C{port=None} reuses the previous port (0 the
        first time), so a test can stop listening and come back.
        """
        if self._listening is not None:
            return fail(RuntimeError("already listening"))
        number = self._last_port if port is None else port
        factory = cast(ServerFactory, self._factory)
        try:
            listening = reactor.listenTCP(number, factory, interface=interface)
        except CannotListenError:
            return fail()
        self._listening = listening
        self._last_port = cast(IPv4Address | IPv6Address, listening.getHost()).port
        self._interface = interface
        return succeed(listening)

    @property
    def listening_port(self) -> IListeningPort | None:
        return self._listening

    @property
    def port(self) -> int:
        """The port number (the last one, after L{stop_listening})."""
        if not self._last_port:
            raise RuntimeError("never listened")
        return self._last_port

    @property
    def url(self) -> str:
        host = f"[{self._interface}]" if ":" in self._interface else self._interface
        return f"http://{host}:{self.port}"

    def stop_listening(self) -> Deferred[None]:
        """Close the listening port; open connections stay as they are."""
        listening, self._listening = self._listening, None
        if listening is None:
            return succeed(None)
        return maybeDeferred(listening.stopListening).addCallback(lambda _: None)

    def stop(self) -> Deferred[None]:
        """
        Close the port, cancel every timer and drop every connection (held
        requests included); fires once all of them are gone.
        """
        for exchange in list(self._exchanges):
            exchange.cancel()
        self._exchanges.clear()
        waits = [self.stop_listening(), *self._factory.drop_all()]
        return gatherResults(waits, consumeErrors=True).addCallback(lambda _: None)

    # -- request handling ------------------------------------------------------

    def _family(self, request: Request) -> str:
        route = self._routes.get(request.path.decode("latin-1"))
        return route.family if route is not None else self.dialect

    def _next_behaviour(self, path: str, inference: bool) -> Behaviour:
        queue = self._by_path.get(path)
        if queue:
            return queue.popleft()
        if inference:
            return self._queue.popleft() if self._queue else self.default
        return _PLAIN

    def _cors_headers(self, request: Request) -> None:
        origin = request.requestHeaders.getRawHeaders(b"origin")
        if self.cors is None or not origin:
            return
        for name, value in self.cors.simple(origin[0].decode("latin-1")):
            request.responseHeaders.addRawHeader(name, value)

    def _preflight(self, request: Request) -> bool:
        """Answer a CORS preflight by L{cors}, if it is one."""
        headers = request.requestHeaders
        origin = headers.getRawHeaders(b"origin")
        if (
            self.cors is None
            or request.method != b"OPTIONS"
            or not origin
            or not headers.hasHeader(b"access-control-request-method")
        ):
            return False
        asked = headers.getRawHeaders(b"access-control-request-headers")
        status, pairs, body = self.cors.preflight(
            origin[0].decode("latin-1"), asked[0].decode("latin-1") if asked else None
        )
        self.requests.append(_record(request, b"", None, self.clock.seconds(), _PLAIN))
        out = cast(_Writer, request)
        out.setResponseCode(status)
        for name, value in pairs:
            request.responseHeaders.addRawHeader(name, value)
        out.setHeader(b"Content-Length", b"%d" % len(body))
        out.write(body)
        out.finish()
        return True

    def _handle(self, request: Request) -> None:
        if self._preflight(request):
            return
        content = request.content
        raw = content.read() if content is not None else b""
        method = request.method.decode("ascii")
        path = request.path.decode("latin-1")
        form = _form(request)
        body: Mapping[str, Any] = {}
        problem: str | None = None
        unparsable: ValueError | None = None
        if raw and not form and method in ("POST", "PUT", "PATCH"):
            try:
                parsed = json.loads(raw)
            except ValueError as e:
                unparsable = e
            except RecursionError:
                unparsable = ValueError("nested too deeply")
            else:
                if isinstance(parsed, Mapping):
                    body = parsed
                else:
                    problem = "request body must be a JSON object"
        route = self._routes.get(path)
        inference = route is not None and route.inference
        behaviour = self._next_behaviour(path, inference)
        model = dialects.model_of(body, form)
        now = self.clock.seconds()
        self.requests.append(_record(request, raw, model, now, behaviour))
        if route is None:
            reply = dialects.unknown_route(self.dialect, method, path)
        elif method not in route.methods:
            reply = dialects.error_reply(route.family, 405, "method not allowed")
        elif unparsable is not None:
            reply = dialects.bad_json(route.family, unparsable)
        elif problem is not None:
            reply = dialects.error_reply(route.family, 400, problem)
        else:
            call = dialects.Call(
                method=method,
                path=path,
                body=body,
                form=form,
                models=self.models,
                now=now,
                seq=len(self.requests),
                tokens=behaviour.chunks,
                usage=behaviour.report_usage,
                force_usage=behaviour.always_stream_usage,
            )
            reply = route.handler(call)
        exchange = _Exchange(self, request, behaviour, reply)
        self._exchanges.add(exchange)
        exchange.start()


def _form(request: Request) -> dict[str, str]:
    kind = request.requestHeaders.getRawHeaders(b"content-type", [b""])[0]
    if not kind.lower().startswith(b"multipart/form-data"):
        return {}
    args: dict[bytes, list[bytes]] = request.args or {}
    return {
        k.decode("utf-8", "replace"): v[0].decode("utf-8", "replace")
        for k, v in args.items()
        if v
    }


def _record(
    request: Request, raw: bytes, model: str | None, now: float, b: Behaviour
) -> RecordedRequest:
    pairs = tuple(
        (name, value)
        for name, values in request.requestHeaders.getAllRawHeaders()
        for value in values
    )
    joined: dict[str, str] = {}
    for name, value in pairs:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        joined[key] = f"{joined[key]}, {text}" if key in joined else text
    peer = cast(_Writer, request).getClientAddress()
    return RecordedRequest(
        method=request.method.decode("ascii"),
        path=request.path.decode("latin-1"),
        uri=request.uri.decode("latin-1"),
        headers=joined,
        raw_headers=pairs,
        body=raw,
        model=model,
        at=now,
        peer=getattr(peer, "host", None),
        behaviour=b,
    )


# -- command line ----------------------------------------------------------------


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m nvproxy.testing.fakeengine",
        description="A fake LLM engine (healthy behaviour) for manual testing.",
    )
    parser.add_argument("--dialect", choices=DIALECTS, default="ollama")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--models", default="fake-model", help="comma-separated")
    return parser.parse_args(argv)


def _serve(reactor: Any, args: argparse.Namespace) -> Deferred[None]:
    clock = cast(IReactorTime, reactor)
    models = [m for m in args.models.split(",") if m]
    engine = FakeEngine(dialect=args.dialect, models=models, clock=clock)
    done: Deferred[None] = Deferred()

    def ready(port: IListeningPort) -> None:
        address = cast(IPv4Address | IPv6Address, port.getHost())
        print(f"listening on {args.host}:{address.port}", flush=True)

    def start() -> None:
        # Only once running: by then SIGTERM/SIGINT handlers are installed, so
        # a signal sent right after the "listening" line stops us cleanly.
        d = engine.listen(cast(IReactorTCP, reactor), args.port, args.host)
        d.addCallbacks(ready, done.errback)

    core = cast(IReactorCore, reactor)
    core.addSystemEventTrigger("before", "shutdown", engine.stop)
    core.callWhenRunning(start)
    return done


def main(argv: Sequence[str] | None = None) -> None:
    """Run a fake engine until SIGTERM/SIGINT."""
    from twisted.internet.task import react

    args = _parse(sys.argv[1:] if argv is None else argv)
    react(_serve, (args,))


if __name__ == "__main__":
    main()
