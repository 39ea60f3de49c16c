"""
The access line's structured fields are exactly L{ACCESS_FIELDS}, in text
and JSON output alike.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import LogLevel
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request
from twisted.web.test.requesthelper import DummyRequest

from nvproxy.engines import ENGINES
from nvproxy.logs import Logger, event_as_json_line, event_as_text_line
from nvproxy.proxy import accesslog
from nvproxy.proxy.site import FacadeSite


class AccessLineTests(SynchronousTestCase):
    def test_fields(self) -> None:
        events: list[dict[str, Any]] = []
        self.patch(
            accesslog,
            "log",
            Logger(namespace="nvproxy.access", observer=events.append),
        )
        request = DummyRequest([b"api", b"chat"])
        request.method = b"POST"
        request.path = b"/api/chat"
        request.startedWriting = 1
        request.code = 200
        request.sentLength = 512
        record = accesslog.access_of(request)
        record.engine, record.model, record.node, record.attempts = (
            "ollama",
            "m",
            "gpu-1",
            2,
        )
        accesslog.emit(request, 10.0, 10.04, 11.5, completed=True)
        (event,) = [e for e in events if e.get("log_namespace") == "nvproxy.access"]
        self.assertEqual(event["log_level"], LogLevel.info)
        fields = [key for key in event if not key.startswith("log_")]
        self.assertEqual(sorted(fields), sorted(accesslog.ACCESS_FIELDS))
        text = event_as_text_line(dict(event))
        assert text is not None
        self.assertIn(
            "POST /api/chat 200 engine=ollama model=m node=gpu-1 attempts=2"
            " ttfb_ms=40 duration_ms=1500 bytes=512 outcome=finished request_id=None",
            text,
        )
        self.assertIn('"attempts": 2', event_as_json_line(dict(event)))


class _Hold(Resource):
    """Answers C{/done} at once; holds anything else open."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes | int:
        if request.path == b"/done":
            return b"ok"
        return NOT_DONE_YET


class FacadeAccessTests(SynchronousTestCase):
    """
    A facade site logs one access line per request, on the reactor turn
    after the response ended, every line of a turn together.
    """

    def setUp(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.patch(
            accesslog,
            "log",
            Logger(namespace="nvproxy.access", observer=self.events.append),
        )
        self.clock = Clock()
        self.site = FacadeSite(
            _Hold(),
            error_body=ENGINES["ollama"].error_body,
            max_body=1000,
            max_connections=10,
            reactor=self.clock,
            access_log=True,
        )

    def connect(self) -> tuple[Any, StringTransport]:
        transport = StringTransport()
        channel = self.site.buildProtocol(None)
        channel.makeConnection(transport)
        return channel, transport

    def now(self) -> list[Any]:
        """The calls due this turn (the channels' idle timeouts are not)."""
        now = self.clock.seconds()
        return [c for c in self.clock.getDelayedCalls() if c.getTime() == now]

    def lines(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("log_namespace") == "nvproxy.access"]

    def test_lines_of_one_turn_logged_together_on_the_next(self) -> None:
        one, _ = self.connect()
        two, _ = self.connect()
        one.dataReceived(b"GET /done HTTP/1.1\r\nHost: x\r\n\r\n")
        two.dataReceived(b"GET /done HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(self.lines(), [])
        self.assertEqual(len(self.now()), 1)
        self.clock.advance(0)
        lines = self.lines()
        self.assertEqual(
            [(e["status"], e["outcome"]) for e in lines], [(200, "finished")] * 2
        )
        self.assertEqual(self.now(), [])

    def test_client_gone(self) -> None:
        channel, _ = self.connect()
        channel.dataReceived(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
        channel.connectionLost(Failure(ConnectionDone()))
        self.clock.advance(0)
        (line,) = self.lines()
        self.assertEqual((line["status"], line["outcome"]), (None, "client_gone"))

    def test_finished_then_lost_logged_once(self) -> None:
        channel, _ = self.connect()
        channel.dataReceived(b"GET /done HTTP/1.1\r\nHost: x\r\n\r\n")
        channel.connectionLost(Failure(ConnectionDone()))
        self.clock.advance(0)
        self.assertEqual(len(self.lines()), 1)

    def test_off(self) -> None:
        self.site.access_log = False
        channel, _ = self.connect()
        channel.dataReceived(b"GET /done HTTP/1.1\r\nHost: x\r\n\r\n")
        self.clock.advance(0)
        self.assertEqual(self.lines(), [])
