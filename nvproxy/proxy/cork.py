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

So while an upstream read is handled (L{Cork.during}), a facade channel hands
what it is asked to write to the cork to hold (L{Cork.hold}); when the read
has been handled, each holder that held something is told to flush
(L{Holder.flush}) and hands it to its socket in one call, or queues it behind
what is already queued (L{send_now}).  Nothing waits for anything but the end
of the read it came from.

A request to an engine or a peer is written the same way: Twisted's client
protocol writes its head and body with a C{write} each, and L{hold} and
L{release} keep them for the length of that call and send them in one piece
at its end, when it is the reactor turn's first (L{Turn}; the others take
Twisted's queue).  L{send_now} also sends through TLS (a peer's connection):
the records OpenSSL makes of the bytes go to the socket as they come.
"""

from __future__ import annotations

from collections.abc import Callable
from errno import ENOBUFS, EWOULDBLOCK
from functools import partial
from typing import Any, Protocol

from attrs import frozen
from twisted.internet.interfaces import IReactorTime
from twisted.internet.tcp import Client, Server
from twisted.protocols.tls import TLSMemoryBIOProtocol
from twisted.python.util import untilConcludes

__all__ = [
    "CORK",
    "GATHER_AT",
    "Cork",
    "Held",
    "Holder",
    "Turn",
    "cover",
    "hold",
    "release",
    "send_gathered",
    "send_now",
    "uncover",
]


class Holder(Protocol):
    """A client connection that can hold writes for the length of a read."""

    def send_held(self, held: list[bytes]) -> None:
        """Write C{held}, what the cork held for it during a read."""


class Cork:
    """
    Whether an upstream read is being handled, and what each holder was
    asked to write during it.

    What a holder holds is kept here, not on the holder: a facade channel
    has as many attributes as Python shares one key table for
    (L{nvproxy.proxy.site}), and one more would give every channel a dict
    of its own.
    """

    def __init__(self) -> None:
        self.active = False
        self._held: dict[Holder, list[bytes]] = {}

    def hold(self, holder: Holder, data: bytes) -> None:
        """Keep C{data} for C{holder}, after what it already holds."""
        held = self._held.get(holder)
        if held is None:
            self._held[holder] = [data]
        else:
            held.append(data)

    def take(self, holder: Holder) -> list[bytes] | None:
        """What C{holder} holds, no longer held; C{None} when nothing."""
        return self._held.pop(holder, None) if self._held else None

    def during(self, receive: Callable[[bytes], None], data: bytes) -> None:
        """
        C{receive(data)} with the cork on, then L{end}.  A read handled
        inside another (none is, in Twisted) leaves the end to the outer
        one.  (The upstream protocol does the same inline: L{active}, set
        and read, then L{end}.)
        """
        if self.active:
            receive(data)
            return
        self.active = True
        try:
            receive(data)
        finally:
            self.end()

    def end(self) -> None:
        """The read is handled: the cork is off, and each holder that held
        something is handed it to send."""
        self.active = False
        held = self._held
        while held:
            holder, data = held.popitem()
            holder.send_held(data)


CORK = Cork()
"""The process's one cork (one reactor, one read handled at a time)."""


_TCP = (Server, Client)


def _idle(transport: Any) -> bool:
    """C{transport} is a plain TCP connection, open, with nothing queued."""
    return (
        type(transport) in _TCP
        and not transport._tempDataLen
        and not transport.dataBuffer
        and not transport.disconnecting
        and not transport._writeDisconnecting
        and not transport._aborting
        and transport.connected
    )


def _tls_idle(transport: Any) -> bool:
    """C{transport} is TLS, open, over an idle TCP connection, nothing held."""
    return (
        isinstance(transport, TLSMemoryBIOProtocol)
        and not transport.disconnecting
        and not transport._lostTLSConnection
        and not transport._appSendBuffer
        and _idle(transport.transport)
    )


def _tcp_send(transport: Any, data: bytes) -> bool:
    sent = transport.writeSomeData(data)
    if not isinstance(sent, int):
        # Lost: queue it, and the reactor's next write reports the loss.
        return False
    if sent < len(data):
        # The class's write: under TLS, the instance's is _tcp_write_now,
        # which would send the rest again ahead of this queue.
        type(transport).write(transport, data[sent:])
    return True


def _tcp_write_now(transport: Any, data: bytes) -> None:
    """C{write} for a TCP connection under TLS, for the length of one call."""
    if not (_idle(transport) and _tcp_send(transport, data)):
        type(transport).write(transport, data)


def cover(target: Any, name: str, value: object) -> Any:
    """
    Set C{target.name} to C{value} as an instance attribute; what the
    instance had under that name (Twisted's client TLS keeps its C{write}
    there) or C{None}, for L{uncover}.

    The instance's own is told from the class's method by what reading the
    name gives, not by C{vars(target)}: asking CPython for an instance's
    C{__dict__} makes it keep the attributes in a dict from then on, and
    every later attribute read of a connection (each of its reads, each of
    its writes) is slower.
    """
    current = getattr(target, name, None)
    if getattr(current, "__self__", None) is target and getattr(
        current, "__func__", None
    ) is getattr(type(target), name, None):
        current = None  # the class's method: nothing of the instance's
    setattr(target, name, value)
    return current


def uncover(target: Any, name: str, before: object) -> None:
    """Put back what L{cover} covered."""
    if before is None:
        delattr(target, name)
    else:
        setattr(target, name, before)


GATHER_AT = 4096
"""
From how many bytes what a channel held in pieces goes to the socket as it
is, in one C{sendmsg} over the pieces (L{send_gathered}), not joined into
one string first: a relayed read of a streamed answer (tens of KB when an
engine is fast) was copied twice over, once to frame it as a chunk and
once to join it to the head and the last chunk.  Below it a join costs
less than the gather.
"""


def send_gathered(transport: Any, pieces: list[bytes]) -> bool:
    """
    Hand C{pieces} to the kernel now, in order and without joining them,
    when they come to at least L{GATHER_AT} bytes and C{transport} is a
    plain TCP connection with nothing queued; whether it did (if not, the
    caller joins them for L{send_now}).  What the socket does not take (a
    slow client) is queued the ordinary way, as L{send_now} queues it.
    """
    if sum(map(len, pieces)) < GATHER_AT or not _idle(transport):
        return False
    try:
        sent: int = untilConcludes(transport.socket.sendmsg, pieces)
    except OSError as error:
        if error.errno not in (EWOULDBLOCK, ENOBUFS):
            return False  # lost: the caller queues, the reactor reports it
        sent = 0
    for index, piece in enumerate(pieces):
        if sent < len(piece):
            rest = [piece[sent:], *pieces[index + 1 :]] if sent else pieces[index:]
            type(transport).writeSequence(transport, rest)
            break
        sent -= len(piece)
    return True


def send_now(transport: object, data: bytes) -> bool:
    """
    Hand C{data} to the kernel now when C{transport} is a TCP connection
    (or TLS over one) with nothing queued; whether it did.  What the socket
    does not take (a slow client) is queued the ordinary way, so flow control
    and ordering stay Twisted's.  Over TLS, C{True} means the bytes went into
    the TLS connection, whose records went to the socket as they came.
    """
    if _idle(transport):
        return _tcp_send(transport, data)
    if not _tls_idle(transport):
        return False
    tls: Any = transport
    tcp = tls.transport
    # Twisted's client TLS gathers small writes until the next reactor turn
    # (BufferingTLSTransport); what it gathered goes first.
    aggregator = getattr(tls, "_aggregator", None)
    if aggregator is not None:
        aggregator.flush()
    # TLSMemoryBIOProtocol writes its records with its transport's write: for
    # this call, that write sends at once (an instance attribute, put back
    # after the call, so nothing is left pointing back at the connection).
    before = cover(tcp, "write", partial(_tcp_write_now, tcp))
    try:
        TLSMemoryBIOProtocol.write(tls, data)
    finally:
        uncover(tcp, "write", before)
    return True


class Turn:
    """
    Whether this reactor turn has sent a request at once (L{hold}).

    A request that is alone in its turn (one client) gains by leaving at
    once: the engine works on it while the rest of the turn runs, and its
    answer is often in before the next poll, so nvproxy does not sleep and
    wake for it.  In a burst (many clients) each such send would wake the
    engine again after it had gone back to sleep, which costs the sender
    more system time than it saves; so only the turn's first request
    leaves at once, and the others take Twisted's queue, sent together at
    the next poll.
    """

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._used = False

    @property
    def available(self) -> bool:
        """No request has been sent at once in this turn yet."""
        return not self._used

    def use(self) -> None:
        """A request is being sent at once: the next ones of this turn wait."""
        if not self._used:
            self._used = True
            self._clock.callLater(0, self._reset)

    def _reset(self) -> None:
        self._used = False


@frozen
class Held:
    """What L{hold} keeps, and the transport's own attributes it covers."""

    data: list[bytes]
    write: object
    writeSequence: object


def hold(transport: Any) -> Held | None:
    """
    Start keeping what is written to C{transport} (TCP, or TLS over TCP,
    with nothing queued), or C{None} when the ordinary path must be kept.
    Always followed by L{release}, in a C{finally}.
    """
    if not (_idle(transport) or _tls_idle(transport)):
        return None
    data: list[bytes] = []
    return Held(
        data,
        cover(transport, "write", data.append),
        cover(transport, "writeSequence", data.extend),
    )


def release(transport: Any, held: Held, turn: Turn | None = None) -> None:
    """
    Stop holding (L{hold}), the transport's own C{write} back, and send what
    was held, in one piece: at once, or, when C{turn} has already sent one
    at once, the ordinary way.
    """
    uncover(transport, "write", held.write)
    uncover(transport, "writeSequence", held.writeSequence)
    pieces = held.data
    if pieces:
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if turn is not None:
            if not turn.available:
                transport.write(data)
                return
            turn.use()
        if not send_now(transport, data):
            transport.write(data)
