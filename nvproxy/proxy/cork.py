# -*- test-case-name: tests.test_site -*-
"""
What an upstream read makes the facades write leaves at the end of that read,
one C{send} per client connection, without waiting for the next poll.

Twisted's C{write} only queues: it registers the socket for writability (an
C{epoll_ctl}), the next poll reports it writable, C{doWrite} sends, and
finding the queue empty unregisters it (a second C{epoll_ctl}).  For a
proxy that is the common case twice over: an answer's head, body and end,
written by the relay as one upstream read is handled, wait for the next poll
round; and a streamed chunk that arrives alone waits behind every other read
that poll reported (a burst of other streams' chunks is read, all of it,
before any is sent).

So while an upstream read is handled (L{Cork.during}), a facade channel holds
what it is asked to write and tells the cork (L{Cork.holding}); when the read
has been handled,
each holder that held something is told to flush (L{Holder.flush}) and hands
it to its socket in one call, or queues it behind what is already queued
(L{nvproxy.proxy.site._send_now}).  Nothing waits for anything but the end
of the read it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["CORK", "Cork", "Holder"]


class Holder(Protocol):
    """A client connection that can hold writes for the length of a read."""

    def flush(self) -> None:
        """Write what was held."""


class Cork:
    """
    Whether an upstream read is being handled, and which holders held
    writes during it.
    """

    def __init__(self) -> None:
        self.active = False
        self._held: list[Holder] = []

    def holding(self, holder: Holder) -> None:
        """C{holder} has started holding writes during this read."""
        self._held.append(holder)

    def during(self, receive: Callable[[bytes], None], data: bytes) -> None:
        """
        C{receive(data)} with the cork on, then flush every holder.  A read
        handled inside another (none is, in Twisted) leaves the flush to the
        outer one.
        """
        if self.active:
            receive(data)
            return
        self.active = True
        try:
            receive(data)
        finally:
            self.active = False
            held, self._held = self._held, []
            for holder in held:
                holder.flush()


CORK = Cork()
"""The process's one cork (one reactor, one read handled at a time)."""
