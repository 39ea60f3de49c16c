# -*- test-case-name: tests.test_poll -*-
"""
The epoll reactor's poll, without a log context built for every event.

Twisted's epoll reactor serves each ready descriptor through
C{twisted.python.log.callWithLogger}: it asks the selectable for its
C{logPrefix}, copies the log context twice and pushes it on the thread's
context stack, so that a legacy C{log.msg} or C{log.err} made while the
descriptor is served is tagged with its connection (C{[HTTPChannel,3,
127.0.0.1] Unhandled Error}).  Such a message is rare (a protocol's bug),
but the tag was paid for on every read and every buffered write: a chat
request's two or three events, and a streamed token's one, about 17K
instructions each under callgrind (a fifth of what relaying a lone token
cost).

L{serve_events_untagged} gives one reactor a poll that serves each event
directly and computes the tag only when a legacy message asks for it: the
default log context becomes L{_ServedTag}, whose C{copy} (what both of the
legacy log's readers of the context call) names the selectable being served
then.  What is logged, and how, is what Twisted's poll logs: the same
tag, C{callWithLogger}'s catch-all for what escapes an event, and the same
failures from inside it (a test runs both polls side by side).
"""

from __future__ import annotations

import errno
import threading
from typing import Any

from twisted.internet.epollreactor import EPollReactor
from twisted.python import context, log

__all__ = ["serve_events_untagged"]


class _ServedTag(dict[str, str]):
    """
    The legacy log's default context (C{{"system": "-"}}), whose copies name
    the selectable the reactor's thread is serving, as C{callWithLogger}'s
    context did.
    """

    __slots__ = ("_thread", "serving")

    def __init__(self, base: dict[str, str], thread: int) -> None:
        super().__init__(base)
        self.serving: Any = None
        self._thread = thread

    def copy(self) -> dict[str, str]:
        copied = dict(self)
        serving = self.serving
        if serving is not None and threading.get_ident() == self._thread:
            copied["system"] = _prefix(serving)
        return copied


def _prefix(selectable: Any) -> str:
    """C{callWithLogger}'s tag: the selectable's C{logPrefix}."""
    try:
        return str(selectable.logPrefix())
    except Exception:
        return "(buggy logPrefix method)"


def serve_events_untagged(reactor: Any) -> bool:
    """
    Give C{reactor} the untagged poll, if it is Twisted's epoll reactor (on
    any other it does nothing and says so); call it from the reactor's
    thread, before the reactor runs.  Idempotent.
    """
    if type(reactor) is not EPollReactor:
        return False
    # (Not vars(reactor): asking for an instance's __dict__ makes CPython
    # keep its attributes in a dict of their own from then on, and every
    # attribute the reactor reads per event gets slower.)
    if isinstance(reactor.doIteration, _UntaggedPoll):
        return True
    base = context.get(log.ILogContext)
    tag = base if isinstance(base, _ServedTag) else None
    if tag is None:
        tag = _ServedTag(base, threading.get_ident())
        context.setDefault(log.ILogContext, tag)
    reactor.doIteration = _UntaggedPoll(reactor, tag)  # type: ignore[method-assign]
    return True


class _UntaggedPoll:
    """C{EPollReactor.doPoll}, each event served with the tag set lazily."""

    __slots__ = ("_reactor", "_tag")

    def __init__(self, reactor: Any, tag: _ServedTag) -> None:
        self._reactor = reactor
        self._tag = tag

    def __call__(self, timeout: float | None) -> None:
        reactor = self._reactor
        try:
            events = reactor._poller.poll(
                -1 if timeout is None else timeout, len(reactor._selectables)
            )
        except OSError as e:
            if e.errno == errno.EINTR:
                return
            raise
        serve = reactor._doReadOrWrite
        selectables = reactor._selectables
        tag = self._tag
        outer = tag.serving  # (None, unless an event's code iterates the reactor)
        for fd, event in events:
            selectable = selectables.get(fd)
            if selectable is None:
                continue
            tag.serving = selectable
            try:
                serve(selectable, fd, event)
            except KeyboardInterrupt:
                raise
            except BaseException:
                log.err(system=_prefix(selectable))
            finally:
                tag.serving = outer
