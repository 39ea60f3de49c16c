"""
L{nvproxy.poll}: the untagged poll serves and logs exactly what Twisted's
epoll poll does.  Every behaviour test runs twice, on a stock
C{EPollReactor} and on one given the untagged poll, each polled by hand
(never run) over a socket pair.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet.epollreactor import EPollReactor
from twisted.internet.task import Clock
from twisted.python import context, log
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.poll import _ServedTag, serve_events_untagged


class _Descriptor:
    """A readable end of a socket pair, doing what a test asks per read."""

    def __init__(self, sock: socket.socket, name: str, on_read: Any) -> None:
        self._sock = sock
        self._name = name
        self._on_read = on_read
        self.lost: list[Failure] = []

    def fileno(self) -> int:
        return self._sock.fileno()

    def logPrefix(self) -> str:
        return self._name

    def doRead(self) -> object:
        self._sock.recv(64)
        return self._on_read()

    def connectionLost(self, reason: Failure) -> None:
        self.lost.append(reason)


class _PollMixin:
    untagged: bool

    def setUp(self) -> None:
        test: Any = self
        default = context.get(log.ILogContext)
        test.addCleanup(context.setDefault, log.ILogContext, default)
        reactor: Any = EPollReactor()
        test.addCleanup(self._close, reactor)
        if self.untagged:
            test.assertTrue(serve_events_untagged(reactor))
        self.reactor = reactor
        self.events: list[dict[str, Any]] = []
        log.addObserver(self.events.append)
        test.addCleanup(log.removeObserver, self.events.append)

    def _close(self, reactor: Any) -> None:
        # (The sockets are closed by then: closing the poller drops them.)
        reactor.waker.connectionLost(None)
        reactor._poller.close()

    def _ready(
        self, name: str, on_read: Any, kind: type[_Descriptor] = _Descriptor
    ) -> _Descriptor:
        """A descriptor of C{kind}, added to the reactor, with a byte to read."""
        test: Any = self
        ours, theirs = socket.socketpair()
        test.addCleanup(ours.close)
        test.addCleanup(theirs.close)
        descriptor = kind(ours, name, on_read)
        self.reactor.addReader(descriptor)
        theirs.send(b"x")
        return descriptor

    def _poll(self) -> None:
        self.reactor.doIteration(0)

    def _systems(self, text: str) -> list[str]:
        return [
            event["system"]
            for event in self.events
            if text in "".join(map(str, event.get("message", ())))
            or (event.get("why") or "") == text
        ]

    def test_message_tagged_with_connection(self) -> None:
        """
        A legacy message logged while a descriptor is served names it; one
        logged after the poll does not.
        """
        self._ready("Conn,7,127.0.0.1", lambda: log.msg("inside"))
        self._poll()
        log.msg("outside")
        test: Any = self
        test.assertEqual(self._systems("inside"), ["Conn,7,127.0.0.1"])
        test.assertEqual(self._systems("outside"), ["-"])

    def test_nested_context_sees_tag(self) -> None:
        """
        C{callWithContext} inside a served descriptor starts from its tag.
        """

        def read() -> None:
            log.callWithContext({"extra": "1"}, log.msg, "nested")

        self._ready("Conn,8,127.0.0.1", read)
        self._poll()
        test: Any = self
        test.assertEqual(self._systems("nested"), ["Conn,8,127.0.0.1"])

    def test_read_error_logged_and_disconnected(self) -> None:
        """
        A read that raises is logged with the connection's tag, and the
        descriptor is disconnected with the error (Twisted's own handling).
        """

        def read() -> None:
            raise ZeroDivisionError("boom")

        descriptor = self._ready("Conn,9,127.0.0.1", read)
        self._poll()
        test: Any = self
        errors = [e for e in self.events if e.get("isError")]
        test.assertEqual([e["system"] for e in errors], ["Conn,9,127.0.0.1"])
        test.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        test.assertEqual(len(descriptor.lost), 1)
        descriptor.lost[0].trap(ZeroDivisionError)

    def test_escaped_error_logged_and_poll_goes_on(self) -> None:
        """
        An error that escapes the reactor's own handling (here a
        C{connectionLost} that raises) is logged with the tag, and the
        poll's next event is still served.
        """
        served: list[str] = []

        class Broken(_Descriptor):
            def connectionLost(self, reason: Failure) -> None:
                raise KeyError("lost")

        test: Any = self
        self._ready("Broken,1,127.0.0.1", lambda: "done", Broken)
        self._ready("Next,2,127.0.0.1", lambda: served.append("next"))
        self._poll()
        test.assertEqual(served, ["next"])
        errors = [e for e in self.events if e.get("isError")]
        test.assertEqual([e["system"] for e in errors], ["Broken,1,127.0.0.1"])
        test.assertEqual(len(self.flushLoggedErrors(KeyError)), 1)

    def test_keyboard_interrupt_propagates(self) -> None:
        """
        A C{KeyboardInterrupt} that escapes serving an event leaves the poll.
        """

        class Interrupted(_Descriptor):
            def connectionLost(self, reason: Failure) -> None:
                raise KeyboardInterrupt()

        test: Any = self
        self._ready("Int,1,127.0.0.1", lambda: "done", Interrupted)
        test.assertRaises(KeyboardInterrupt, self._poll)
        log.msg("after")
        test.assertEqual(self._systems("after"), ["-"])


class StockPollTests(_PollMixin, SynchronousTestCase):
    """The behaviour, on Twisted's own poll: what the untagged one must match."""

    untagged = False


class UntaggedPollTests(_PollMixin, SynchronousTestCase):
    untagged = True

    def test_installed_once(self) -> None:
        """
        A second call keeps the poll and the context the first installed.
        """
        poll = self.reactor.doIteration
        tag = context.get(log.ILogContext)
        self.assertIsInstance(tag, _ServedTag)
        self.assertTrue(serve_events_untagged(self.reactor))
        self.assertIs(self.reactor.doIteration, poll)
        self.assertIs(context.get(log.ILogContext), tag)

    def test_instance_attributes_not_materialized(self) -> None:
        """
        Installing does not ask for the reactor's C{__dict__} (the check is
        an attribute read), so nothing else is set on it.
        """
        reactor: Any = EPollReactor()
        self.addCleanup(self._close, reactor)
        before = set(vars(reactor))
        serve_events_untagged(reactor)
        self.assertEqual(set(vars(reactor)) - before, {"doIteration"})

    def test_other_thread_untagged(self) -> None:
        """
        A copy made on another thread than the reactor's names no
        connection, whatever the reactor is serving.
        """
        tag = _ServedTag({"system": "-"}, thread=-1)
        tag.serving = _Descriptor(socket.socket(), "Conn,1,x", None)
        self.addCleanup(tag.serving._sock.close)
        self.assertEqual(tag.copy(), {"system": "-"})

    def test_buggy_log_prefix(self) -> None:
        """
        A selectable whose C{logPrefix} raises is tagged as
        C{callWithLogger} tags it.
        """

        class Buggy(_Descriptor):
            def logPrefix(self) -> str:
                raise RuntimeError("no prefix")

        self._ready("", lambda: log.msg("inside"), Buggy)
        self._poll()
        self.assertEqual(self._systems("inside"), ["(buggy logPrefix method)"])

    def test_other_reactors_untouched(self) -> None:
        """Only Twisted's epoll reactor is given the poll."""
        clock = Clock()
        self.assertFalse(serve_events_untagged(clock))
        self.assertFalse(hasattr(clock, "doIteration"))
