# -*- test-case-name: tests.test_site,tests.test_facade -*-
"""
twisted.web plumbing for a facade port and the admin listener: a channel that
bounds how a request head arrives, a request that bounds its body and leaves
it unparsed, and a site that caps its connections.

What a client sees when a limit trips (each answer carries C{Connection:
close} and the connection then closes; the body is an error in the engine's
dialect on a facade, C{{"error": "..."}} on the admin listener):

* request line and headers not complete within C{header_timeout} of the
  request's first byte (an absolute deadline: bytes trickling in do not
  extend it): C{408};
* a request line longer than C{max_request_line}: C{414};
* a header section (the lines after the request line, with their line
  endings) larger than C{max_header_bytes}, or more than C{max_header_count}
  header fields: C{431};
* a CR or LF that is not part of a CRLF in the head or in a chunk-size line,
  a chunk size of more than 16 hex digits or not hexadecimal, or any other
  malformed head or chunked framing: C{400};
* body larger than C{max_body}: C{413} (the rest of the body is not read);
* more than C{max_connections} open connections (facades): C{503} with
  C{Retry-After: 1} and an immediate close;
* silence for C{idle_timeout} between requests or while a body arrives: the
  connection is closed without an answer.

The header deadline starts when the channel is connected (for a facade: at
the connection's first byte, which is when the first-byte demux hands it
over; on the admin listener: at accept) and, for each later request on a
keep-alive connection, at the first byte the channel reads of it.  A head
that is whole in the read that starts it has no deadline to meet.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache
from operator import attrgetter
from types import MappingProxyType
from typing import Any
from urllib.parse import unquote_to_bytes as unquote  # as twisted.web.server

from attrs import define, frozen
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IAddress, IDelayedCall
from twisted.internet.protocol import Protocol, connectionDone
from twisted.protocols.basic import LineReceiver
from twisted.python.failure import Failure
from twisted.web.http import (
    HTTPChannel,
    _ChunkedTransferDecoder,
    _IdentityTransferDecoder,
    _MalformedChunkedDataError,
    _parseRequestLine,
    datetimeToString,
    parse_qs,
)
from twisted.web.http_headers import Headers, InvalidHeaderName, _nameEncoder
from twisted.web.iweb import INonQueuedRequestFactory
from twisted.web.resource import IResource, _IEncodingResource
from twisted.web.server import Request, Site
from twisted.web.server import version as server_version

from nvproxy.jsonhttp import json_bytes
from nvproxy.logs import Logger, batched
from nvproxy.proxy.accesslog import AccessLine, emit
from nvproxy.proxy.cork import CORK, GATHER_AT, send_gathered, send_now
from nvproxy.proxy.headers import CONTENT_LENGTH, DATE, SERVER

log = Logger()

#: A chunk size of more hex digits than this is refused (2**64 is plenty).
MAX_CHUNK_SIZE_DIGITS = 16

_HEX = frozenset(b"0123456789abcdefABCDEF")

_bare_cr_lf = re.compile(rb"[\r\n]").search
"""Whether a line holds a CR or LF.  Not C{b"\\r" in line}: a C{bytes}
membership test tries its operand as an integer first, and raises and
clears a C{TypeError} with a formatted message for every C{bytes} one."""

_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
}


@frozen
class ClientLimits:
    """
    How a request head must arrive; see the module docstring for the answers.

    @ivar header_timeout: seconds from a request's first byte to the end of
        its headers.
    @ivar idle_timeout: seconds of silence between requests (or mid-body)
        after which a connection is closed.
    @ivar max_request_line: bytes, without the CRLF.
    @ivar max_header_bytes: bytes of header lines with their CRLFs, not
        counting the request line or the empty line ending the head.
    @ivar max_header_count: header field lines (continuation lines excluded).
    """

    header_timeout: float = 30.0
    idle_timeout: float = 60.0
    max_request_line: int = 8 * 2**10
    max_header_bytes: int = 64 * 2**10
    max_header_count: int = 100


def origin_form(target: bytes) -> bytes:
    """
    A request target as its path and query: an absolute-form target
    (C{http://host/path?q}, which a server must accept, RFC 9112 §3.2.2) is
    routed and forwarded as C{/path?q}; any other target is unchanged.
    """
    if target.startswith(b"/"):
        return target
    scheme, sep, rest = target.partition(b"://")
    if not sep or not scheme.isalpha():
        return target
    for cut, char in ((rest.find(b"/"), b""), (rest.find(b"?"), b"/")):
        if cut >= 0:
            return char + rest[cut:]
    return b"/"


def plain_error_body(status: int, message: str) -> bytes:
    """The admin listener's error body: C{{"error": message}}."""
    return json_bytes({"error": message})


def _chunk_size_error(line: bytes, complete: bool) -> str | None:
    """
    Why the chunk-size line C{line} (without its CRLF; C{complete} is false
    while the CRLF has not arrived yet) is malformed, or L{None}.
    """
    digits = 0
    for byte in line:
        if byte not in _HEX:
            break
        digits += 1
    if digits > MAX_CHUNK_SIZE_DIGITS:
        return f"chunk size has more than {MAX_CHUNK_SIZE_DIGITS} hex digits"
    rest = line[digits:]
    if not complete and rest.endswith(b"\r"):
        rest = rest[:-1]
        if not rest and not digits:
            return "chunk size is not hexadecimal"
    if _bare_cr_lf(rest):
        return "bare CR or LF in a chunk-size line"
    if (rest and not rest.startswith(b";")) or (not digits and (rest or complete)):
        return "chunk size is not hexadecimal"
    return None


class _StrictChunkedDecoder(_ChunkedTransferDecoder):
    """
    twisted.web's chunked decoder, failing at once on a chunk size it would
    otherwise accept (33 digits: it then waits for 2**132 bytes) or wait on
    (a bare CR: it waits for a CRLF until 1 KiB has arrived).

    @ivar error: why the framing was refused, once it was.
    """

    error: str | None = None

    def _dataReceived_CHUNK_LENGTH(self) -> bool:
        end = self._buffer.find(b"\r\n")
        line = bytes(self._buffer if end < 0 else self._buffer[:end])
        error = _chunk_size_error(line, complete=end >= 0)
        if error is not None:
            self.error = error
            raise _MalformedChunkedDataError(error)
        try:
            return super()._dataReceived_CHUNK_LENGTH()
        except _MalformedChunkedDataError:
            self.error = "malformed chunked body"
            raise

    def _dataReceived_CRLF(self) -> bool:
        try:
            return super()._dataReceived_CRLF()
        except _MalformedChunkedDataError:
            self.error = "chunk data not followed by CRLF"
            raise


_NO_HEAD = -2
"""L{_GuardedChannel._head_bytes} when no request head is awaited."""
_AWAITING_LINE = -1
"""L{_GuardedChannel._head_bytes} from a request's first byte to its line."""


class _GuardedChannel(HTTPChannel):
    """
    An C{HTTPChannel} whose request heads must arrive within an absolute
    deadline and within the site's size limits, and whose refusals are proper
    answers rather than a bare status line or a silent close.

    twisted.web's own limits (C{MAX_LENGTH}, C{totalHeadersSize},
    C{maxHeaders}) are set just above these on the site's channel class
    (L{_channel_class}), so they never trip first.
    """

    site: GuardedSite

    _head_bytes = _NO_HEAD
    """Where the channel is in a request's head, and whether L{_deadline}
    counts: L{_NO_HEAD} when no head is awaited (the deadline does not
    count), L{_AWAITING_LINE} from a request's first byte to its request
    line, then the header bytes so far.  Once a head is in, the timer is
    left scheduled, not cancelled, and the next request's first byte moves
    it (a reset costs the reactor a tenth of a new timer and a cancel),
    unless that byte's read holds the whole head (L{_whole_head}).
    One attribute for three states: see L{_CHANNEL_ATTRIBUTES}."""
    _head_fields = 0
    _deadline: IDelayedCall | None = None
    _refused = False
    _host: IAddress | None = None

    def connectionMade(self) -> None:
        HTTPChannel.connectionMade(self)
        self._arm_deadline()

    def _hold(self, data: bytes) -> bool:
        """Have the cork keep C{data} for L{flush} if an upstream read is
        being handled."""
        if not CORK.active:
            return False
        CORK.hold(self, data)
        return True

    def flush(self) -> None:
        held = CORK.take(self)
        if held:
            self.send_held(held)

    def send_held(self, held: list[bytes]) -> None:
        if len(held) == 1:
            data = held[0]
        elif send_gathered(self.transport, held):
            return
        else:
            data = b"".join(held)
        if not send_now(self.transport, data):
            HTTPChannel.write(self, data)

    def write(self, data: bytes) -> None:
        if not self._hold(data):
            HTTPChannel.write(self, data)

    def loseConnection(self) -> None:
        # What is held goes first: a TLS connection (a peer) drops what is
        # written after its loseConnection, which an answer's end (HTTP/1.0,
        # Connection: close) calls inside the read.
        self.flush()
        HTTPChannel.loseConnection(self)

    def requestDone(self, request: Request) -> None:
        # The answer is whole: it goes now, not at the end of the upstream
        # read that completed it, so the client does not wait for the
        # bookkeeping that follows in the same read (the stats, the job's
        # outcome, the workload events, the metrics, the access line).
        self.flush()
        HTTPChannel.requestDone(self, request)

    def _send100Continue(self) -> None:
        # Twisted writes it to the transport: behind an answer still held
        # (a pipelined request parsed inside the read that ended the one
        # before it), not ahead of it.
        self.flush()
        HTTPChannel._send100Continue(self)

    def writeSequence(self, iovec: Iterable[bytes]) -> None:
        if not (CORK.active and self._hold(b"".join(iovec))):
            HTTPChannel.writeSequence(self, iovec)

    def writeHeaders(
        self, version: bytes, code: bytes, reason: bytes, headers: Any
    ) -> None:
        if not (CORK.active and isinstance(headers, Headers)):
            HTTPChannel.writeHeaders(self, version, code, reason, headers)
            return
        # HTTPChannel.writeHeaders, into the held bytes rather than straight
        # to the transport (which would put the head behind the body).
        head = [version, b" ", code, b" ", reason, b"\r\n"]
        for name, values in headers.getAllRawHeaders():
            for value in values:
                head.extend((name, b": ", value, b"\r\n"))
        head.append(b"\r\n")
        self._hold(b"".join(head))

    def getHost(self) -> IAddress:
        # twisted.web asks for every request, and each ask is a getsockname
        # system call; a connection's own address does not change.
        host = self._host
        if host is None:
            host = self._host = HTTPChannel.getHost(self)
        return host

    def dataReceived(self, data: bytes) -> None:
        if self._refused:
            return
        if data and self.line_mode and not self._handlingRequest:
            if not self._whole_head(data):
                self._arm_deadline()
                HTTPChannel.dataReceived(self, data)
        else:
            HTTPChannel.dataReceived(self, data)
        if not self._refused:
            self._check_partial_line()

    def _whole_head(self, data: bytes) -> bool:
        """
        Take a request whose whole head is in C{data}, the read that starts
        it, in one piece: what twisted.web's line-at-a-time parsing and
        L{lineReceived}'s checks would make of it, for a head they would
        accept, without a call per line.  Anything else (a head split over
        reads, one they would refuse, a folded line, a C{Transfer-Encoding})
        is left to them: C{False}, and nothing is changed.  (A connection
        that is not persistent never gets here: its channel does not go
        back to line mode after its answer.)
        """
        if (
            # a request line in already (_head_bytes counts from it on; an
            # empty line before it leaves it negative) or part of one
            self._head_bytes >= 0 or self._buffer or self._busyReceiving
        ):
            return False
        end = data.find(b"\r\n\r\n")
        if end <= 0:
            return False
        head = data[:end]
        lines = head.split(b"\r\n")
        fields = len(lines) - 1
        first = lines[0]
        limits = self.site._limits
        if (
            # every CR and LF is a line's CRLF, and no NUL anywhere
            head.count(b"\r") != fields
            or head.count(b"\n") != fields
            or head.find(b"\x00") >= 0
            or len(first) > limits.max_request_line
            or end - len(first) > limits.max_header_bytes
            or fields > limits.max_header_count
        ):
            return False
        try:
            command, target, version = _parseRequestLine(first)
        except ValueError:
            return False
        raw: dict[bytes, list[bytes]] = {}
        length: int | None = None
        encode = _nameEncoder.encode
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon:
                return False
            try:
                # (a folded line's name starts with a space or tab: no token)
                name = encode(name)
            except InvalidHeaderName:
                return False
            value = value.strip(b" \t")
            if name == b"Content-Length":
                if length is not None or not value.isdigit():
                    return False
                length = int(value)
            elif name == b"Transfer-Encoding":
                return False
            values = raw.get(name)
            if values is None:
                raw[name] = [value]
            else:
                values.append(value)
        # HTTPChannel.dataReceived and lineReceived's, for these lines.
        self.resetTimeout()
        factory = self.requestFactory
        if INonQueuedRequestFactory.providedBy(factory):
            request = factory(self)
        else:
            request = factory(self, len(self.requests))
        self.requests.append(request)
        self._HTTPChannel__first_line = 0
        self._command = command
        self._path = target
        self._version = version
        request.requestHeaders._rawHeaders = raw
        if length is not None:
            self.length = length
            self._transferDecoder = _IdentityTransferDecoder(
                length, request.handleContentChunk, self._finishRequestBody
            )
        # The empty line's, inside LineReceiver's loop (as the rest of the
        # read is, below).
        self._buffer = data[end + 4 :]
        self._busyReceiving = True
        try:
            self.allHeadersReceived()
            if self.length == 0:
                self.allContentReceived()  # type: ignore[no-untyped-call]
            else:
                self.setRawMode()  # type: ignore[no-untyped-call]
        finally:
            self._busyReceiving = False
        transport: Any = self.transport
        if self._buffer and not (transport and transport.disconnecting):
            LineReceiver.dataReceived(self, b"")
        return True

    def lineReceived(self, line: bytes) -> None:
        if self._refused:
            return
        if self._head_bytes == _NO_HEAD:  # a head's first line arms the deadline
            self._arm_deadline()
        limits = self.site._limits  # per line: the attribute, not the property
        if _bare_cr_lf(line):
            self._refuse(400, "bare CR or LF in the request head")
            return
        if self._head_bytes < 0:
            if len(line) > limits.max_request_line:
                self._refuse_request_line()
                return
            if line:
                self._head_bytes = 0
                self._head_fields = 0
        elif line:
            self._head_bytes += len(line) + 2
            if self._head_bytes > limits.max_header_bytes:
                self._refuse_header_bytes()
                return
            if line[0] not in b" \t":
                self._head_fields += 1
                if self._head_fields > limits.max_header_count:
                    self._refuse(
                        431, f"more than {limits.max_header_count} header fields"
                    )
                    return
        HTTPChannel.lineReceived(self, line)

    def lineLengthExceeded(self, line: bytes) -> None:
        if self._head_bytes >= 0:
            self._refuse_header_bytes()
        else:
            self._refuse_request_line()

    def _check_partial_line(self) -> None:
        """
        Judge the line still waiting for its CRLF: twisted.web would wait for
        it until C{MAX_LENGTH} bytes have arrived.
        """
        if not self.line_mode or self._handlingRequest or not self._buffer:
            return
        self._arm_deadline()
        partial = self._buffer
        end = partial.find(b"\r\n")
        if end >= 0:
            partial = partial[:end]
        awaited = partial[:-1] if partial.endswith(b"\r") else partial
        if _bare_cr_lf(awaited):
            self._refuse(400, "bare CR or LF in the request head")
        elif self._head_bytes < 0:
            if len(awaited) > self.site.limits.max_request_line:
                self._refuse_request_line()
        elif self._head_bytes + len(awaited) > self.site.limits.max_header_bytes:
            self._refuse_header_bytes()

    def allHeadersReceived(self) -> None:
        self._head_bytes = _NO_HEAD
        HTTPChannel.allHeadersReceived(self)

    def _maybeChooseTransferDecoder(self, header: bytes, data: bytes) -> bool:
        ok: bool = HTTPChannel._maybeChooseTransferDecoder(self, header, data)
        if ok and type(self._transferDecoder) is _ChunkedTransferDecoder:
            self._transferDecoder = _StrictChunkedDecoder(
                self.requests[-1].handleContentChunk, self._finishRequestBody
            )
        return ok

    def _respondToBadRequestAndDisconnect(self) -> None:
        decoder = self._transferDecoder
        if isinstance(decoder, _StrictChunkedDecoder) and decoder.error is not None:
            self._refuse(400, decoder.error)
        elif self._head_bytes >= 0:
            self._refuse(400, "malformed request head")
        else:
            self._refuse(400, "malformed request")

    def timeoutConnection(self) -> None:
        # HTTPChannel's own logs at info; an idle client is routine.
        log.debug(
            "closed a connection from {peer}: silent for {timeout}s",
            peer=self._peer(),
            timeout=self.timeOut,
        )
        self._close()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel_deadline()
        HTTPChannel.connectionLost(self, reason)
        idle, self._idle = self._idle, None
        if idle is not None and idle.active():
            idle.cancel()

    # -- the idle timeout ---------------------------------------------------
    #
    # TimeoutMixin's, with one difference: twisted.web turns the timeout off
    # while a request is handled (setTimeout(None)) and on again after it,
    # which cancelled the timer and made a new one for every request.  Here
    # the timer is left scheduled while it is off, does nothing if it fires
    # then, and is moved when the timeout comes back on.

    _idle: IDelayedCall | None = None

    def setTimeout(self, period: float | None) -> float | None:
        previous: float | None = self.timeOut
        self.timeOut = period  # type: ignore[assignment]  # Site's float
        if period is not None:
            idle = self._idle
            if idle is not None and idle.active():
                idle.reset(period)
            else:
                self._idle = self.site.reactor.callLater(period, self._idle_passed)
        return previous

    def resetTimeout(self) -> None:
        idle = self._idle
        if idle is not None and self.timeOut is not None:
            idle.reset(self.timeOut)

    def _idle_passed(self) -> None:
        self._idle = None
        if self.timeOut is not None:
            self.timeoutConnection()

    # -- the header deadline ------------------------------------------------

    def adopt_deadline(self, timer: IDelayedCall) -> Callable[[], None]:
        """
        Take the listener's first-byte timer over as the header deadline
        (it is moved, in L{connectionMade}, to start at the first byte);
        what the timer must call when it fires.
        """
        self._deadline = timer
        return self._deadline_passed

    def _arm_deadline(self) -> None:
        if self._head_bytes != _NO_HEAD or self._refused:
            return
        self._head_bytes = _AWAITING_LINE
        deadline = self._deadline
        if deadline is not None and deadline.active():
            deadline.reset(self.site.limits.header_timeout)
        else:
            self._deadline = self.site.reactor.callLater(
                self.site.limits.header_timeout, self._deadline_passed
            )

    def _cancel_deadline(self) -> None:
        self._head_bytes = _NO_HEAD
        deadline, self._deadline = self._deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self._head_bytes == _NO_HEAD:
            return  # between requests, or a body: no head is awaited
        self._refuse(
            408,
            "request line and headers not complete within"
            f" {self.site.limits.header_timeout:g}s",
        )

    # -- refusals -----------------------------------------------------------

    def _refuse_request_line(self) -> None:
        self._refuse(
            414, f"request line exceeds {self.site.limits.max_request_line} bytes"
        )

    def _refuse_header_bytes(self) -> None:
        self._refuse(
            431, f"request headers exceed {self.site.limits.max_header_bytes} bytes"
        )

    def _refuse(self, status: int, reason: str) -> None:
        """
        Answer C{status} with C{reason} in the site's error dialect and close
        the connection; nothing more is read from it.
        """
        if self._refused:
            return
        self._refused = True
        self._cancel_deadline()
        log.debug(
            "refused a request from {peer} with {status}: {reason}",
            peer=self._peer(),
            status=status,
            reason=reason,
        )
        body = self.site.error_body(status, reason)
        self.flush()  # behind an answer still held, as for 100 Continue
        transport = self.transport
        assert transport is not None
        transport.write(
            b"HTTP/1.1 %d %s\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % (status, _REASONS[status], len(body)) + body
        )
        self._close()

    def _close(self) -> None:
        self.setTimeout(None)
        if self.abortTimeout is not None and self._abortingCall is None:
            # A client that does not read cannot hold the connection open.
            self._abortingCall = self.site.reactor.callLater(
                self.abortTimeout, self.forceAbortClient
            )
        self.loseConnection()

    def _peer(self) -> str:
        return str(self.transport.getPeer()) if self.transport else "?"


_CHANNEL_ATTRIBUTES = (
    # Twisted's, in the order a connection sets them.
    "requests",
    "_handlingRequest",
    "_dataBuffer",
    "_transferDecoder",
    "timeOut",
    "connected",
    "transport",
    "_networkProducer",
    "_busyReceiving",
    "_buffer",
    "line_mode",
    "_receivedHeaderSize",
    "_HTTPChannel__first_line",
    "_command",
    "_path",
    "_version",
    "_HTTPChannel__header",
    "_receivedHeaderCount",
    "persistent",
    "length",
    "_savedTimeOut",
    "_requestProducer",
    "_requestProducerStreaming",
    "_waitingForTransport",  # a client that reads slower than it is sent
    # nvproxy's.
    "_idle",
    "_deadline",
    "_head_bytes",
    "_head_fields",
    "_host",
)
"""
What a facade channel sets on itself over its life, but for the rare ways
out (a refusal, an abort).  CPython 3.11 stores an instance's attributes in
a table whose keys all instances of the class share, when the class has
seen at most 30 names (29 with the seed below) and each name was first set
while few instances existed (every new instance takes one name's room).  A
channel that sets one name more gets a dict of its own, 1.6 KB in
tracemalloc; Twisted's channel and nvproxy's set 38 names.  So what
C{Site.buildProtocol} set on every channel (the site, the reactor's
C{callLater}, the request factory and twisted.web's limits) is set on a
class made for the site (L{_channel_class}), nvproxy's head state is one
attribute, the cork keeps what a channel holds, and the class is seeded
with these names before its first connection.
"""


def _request_factory(channel: _GuardedChannel) -> Any:
    return channel.site.requestFactory


def _channel_class(site: GuardedSite) -> type[_GuardedChannel]:
    """
    The channel class of C{site}: its protocol, with what
    C{Site.buildProtocol} sets on each channel set on the class, and the
    class's shared key table seeded with L{_CHANNEL_ATTRIBUTES}.
    """
    limits = site.limits
    base: type[_GuardedChannel] = site.protocol
    cls: type[_GuardedChannel] = type(
        base.__name__,
        (base,),
        {
            "__module__": base.__module__,
            "__doc__": base.__doc__,
            "factory": site,
            "site": site,
            # read from the site, which may be given another after it is made
            "requestFactory": property(_request_factory),
            "callLater": site.reactor.callLater,
            # twisted.web's own limits, each just beyond ours: they answer a
            # bare 400 or close silently.
            "MAX_LENGTH": max(limits.max_request_line, limits.max_header_bytes) + 1,
            "totalHeadersSize": limits.max_request_line + limits.max_header_bytes + 1,
            "maxHeaders": limits.max_header_count + 1,
        },
    )
    _seed_shared_keys(cls, _CHANNEL_ATTRIBUTES)
    return cls


def _seed_shared_keys(cls: type, names: Iterable[str]) -> None:
    """
    Put C{names} in C{cls}'s shared key table, in order, by setting them on
    one throwaway instance: the table stops taking names once the class has
    had a few instances.
    """
    seed: object = object.__new__(cls)
    for name in names:
        object.__setattr__(seed, name, None)


class GuardedSite(Site):
    """
    A site whose channels enforce L{ClientLimits} (the admin listener's).

    @param error_body: the body of an error answer, from status and message.
    """

    protocol = _GuardedChannel  # type: ignore[assignment]
    noisy = False

    def __init__(
        self,
        resource: IResource,
        *,
        error_body: Callable[[int, str], bytes] = plain_error_body,
        limits: ClientLimits = ClientLimits(),
        reactor: Any = None,
    ) -> None:
        Site.__init__(self, resource, timeout=limits.idle_timeout, reactor=reactor)
        self.error_body = error_body
        self.limits = limits
        self.displayTracebacks = False

    @property
    def limits(self) -> ClientLimits:
        return self._limits

    @limits.setter
    def limits(self, limits: ClientLimits) -> None:
        # A reload's new limits hold for the connections made after it.
        self._limits = limits
        self._channel_class = _channel_class(self)

    def buildProtocol(self, addr: IAddress | None) -> Any:
        # Site.buildProtocol's, with what it sets on every channel on the
        # class (_CHANNEL_ATTRIBUTES says why); only the timeout is the
        # channel's own (TimeoutMixin sets it there).
        channel = self._channel_class()
        channel.timeOut = self.timeOut  # type: ignore[assignment]  # Site's float
        return channel


@define
class _Notes:
    """
    What nvproxy keeps about one facade request, in one attribute of it
    (L{_REQUEST_ATTRIBUTES} says why).

    @ivar received: the body's bytes so far.
    @ivar rejected: the body was refused as too large.
    @ivar access_to: the site whose access log the request goes to.
    @ivar received_at: when the head was in (with C{access_to}).
    @ivar first_byte_at: when the answer's first byte was written.
    @ivar logged: the access line is on its way.
    @ivar on_lost: what L{when_lost} registered.
    @ivar chunks_direct: see L{FacadeRequest.write}.
    @ivar request_id: what L{nvproxy.proxy.requestid} keeps.
    @ivar access: what L{nvproxy.proxy.accesslog} keeps.
    @ivar components: C{Componentized}'s cache, when a component is asked for.
    """

    received: int = 0
    rejected: bool = False
    access_to: FacadeSite | None = None
    received_at: float | None = None
    first_byte_at: float | None = None
    logged: bool = False
    on_lost: list[Callable[[Failure], object]] | None = None
    chunks_direct: bool = False
    request_id: object = None
    access: object = None
    components: dict[str, object] | None = None


_NO_COOKIES: Mapping[bytes, bytes] = MappingProxyType({})


def _in_notes(name: str) -> Any:
    """A request attribute read from and written to its L{_Notes}' C{name}."""
    return property(
        attrgetter(f"_notes.{name}"),
        lambda request, value: setattr(request._notes, name, value),
    )


class FacadeRequest(Request):
    """
    A request whose body is bounded and never parsed as a form: a proxy
    forwards bodies, and twisted.web's form parsing would read a whole
    multipart upload into memory.
    """

    # twisted.web adds text/html to a response without a content type; a
    # proxy relays the upstream's headers as they are.
    defaultContentType = None
    # What twisted.web's Request.__init__ sets on every request, where it
    # is the same for all (see __init__): never queued, never a form
    # (requestReceived parses none either way), no cookies until there are
    # some.
    queued = False
    _parsePOSTFormSubmission = False
    # (read-only: parseCookies and addCookie make a request's own first)
    received_cookies: dict[bytes, bytes] = _NO_COOKIES  # type: ignore[assignment]
    cookies: list[bytes] = ()  # type: ignore[assignment]

    def __init__(self, channel: Any, *args: object, **kwargs: object) -> None:
        # twisted.web's Request.__init__ and Componentized's, less what is
        # on the class: seven of the twelve names they set, and the notes
        # (_REQUEST_ATTRIBUTES; a test checks the two agree).  Its other
        # arguments (queued, deprecated, and parsePOSTFormSubmission) are
        # ignored: never queued, never a form.
        self.notifications: list[Deferred[None]] = []
        self.channel = channel
        self.client = channel.getPeer()
        self.host = channel.getHost()
        self.requestHeaders = Headers()
        self.responseHeaders = Headers()
        self.transport = channel.transport
        self._notes = _Notes()

    @property
    def _adapterCache(self) -> dict[str, object]:
        notes = self._notes
        if notes.components is None:
            notes.components = {}
        return notes.components

    @_adapterCache.setter
    def _adapterCache(self, cache: dict[str, object]) -> None:
        self._notes.components = cache

    # what nvproxy.proxy.requestid and nvproxy.proxy.accesslog keep on any
    # request, kept in a facade request's notes
    _nvproxy_request_id = _in_notes("request_id")
    access = _in_notes("access")

    def parseCookies(self) -> None:
        if self.requestHeaders.hasHeader(b"cookie"):
            self.received_cookies = {}
            Request.parseCookies(self)

    def addCookie(self, k: Any, v: Any, *args: Any, **kwargs: Any) -> None:
        if self.cookies is FacadeRequest.cookies:
            self.cookies = []
        Request.addCookie(self, k, v, *args, **kwargs)

    def gotLength(self, length: int | None) -> None:
        limit = _site(self).max_body if self.channel else None
        if limit is not None and length is not None and length > limit:
            self._too_large()
            return
        Request.gotLength(self, length)

    def handleContentChunk(self, data: bytes) -> None:
        notes = self._notes
        if notes.rejected:
            return
        notes.received += len(data)
        limit = _site(self).max_body
        if notes.received > limit:
            self._too_large()
            return
        Request.handleContentChunk(self, data)

    def _too_large(self) -> None:
        self._notes.rejected = True
        site = _site(self)
        body = site.error_body(413, f"request body exceeds {site.max_body} bytes")
        transport = self.channel.transport
        assert transport is not None
        transport.write(
            b"HTTP/1.1 413 Request Entity Too Large\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % len(body) + body
        )
        transport.loseConnection()

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        # twisted.web's Request.requestReceived, without its form parsing:
        # a proxy forwards a form as it came, and twisted.web would read a
        # multipart upload whole into memory.
        notes = self._notes
        if notes.rejected:
            return
        site = _site(self)
        if site.access_log:
            # The channel is gone by the end: keep its site.
            notes.access_to = site
            notes.received_at = site.reactor.seconds()
        content = self.content
        assert content is not None  # (gotLength made it)
        content.seek(0, 0)
        self.args = {}
        self.method = command
        self.uri = uri = origin_form(path)
        self.clientproto = version
        self.path, mark, query = uri.partition(b"?")
        if mark:
            self.args = parse_qs(query, 1)
        self.process()

    def write(self, data: bytes) -> None:
        # Once the head is written and the body is chunked as it is, on a
        # facade channel (chunks_direct), each piece is framed here: what
        # Twisted's Request.write does then, without its checks for the
        # first write, through toChunk, writeSequence and a join, once per
        # relayed read; the cork holds it during an upstream read (the
        # channel's write, less its two calls).
        notes = self._notes
        if notes.chunks_direct:
            if self.finished:
                raise RuntimeError(
                    "Request.write called on a request after Request.finish was called."
                )
            if self._disconnected:
                return
            self.sentLength += len(data)
            if data:
                if not CORK.active:
                    self.channel.write(b"%x\r\n%b\r\n" % (len(data), data))
                elif len(data) < GATHER_AT:
                    framed = b"%x\r\n%b\r\n" % (len(data), data)
                    CORK.hold(self.channel, framed)  # type: ignore[arg-type]
                else:
                    # framed by its neighbours, not copied (send_gathered)
                    holder: Any = self.channel
                    CORK.hold(holder, b"%x\r\n" % len(data))
                    CORK.hold(holder, data)
                    CORK.hold(holder, b"\r\n")
            return
        if notes.first_byte_at is None and notes.access_to is not None:
            notes.first_byte_at = notes.access_to.reactor.seconds()
        Request.write(self, data)
        if CORK.active and not (self.chunked or self._disconnected):
            # The last byte of a Content-Length answer: it is whole, and goes
            # now (with its head, in one send), not at the answer's end, so
            # the client does not wait for the end of the upstream's body to
            # be handled (the attempt's end, finish's cleanup).
            length = self.responseHeaders._rawHeaders.get(CONTENT_LENGTH)
            if length is not None and _is_whole(length, self.sentLength):
                channel: _GuardedChannel = self.channel  # type: ignore[assignment]
                channel.flush()
        if (
            self.chunked
            and self.startedWriting
            and not self._inFakeHead
            and self._encoder is None
            # not a HEAD or no-body answer's no-op (an instance attribute;
            # read, not looked for in vars(self): see cork.cover)
            and getattr(self.write, "__func__", None) is FacadeRequest.write
            and isinstance(self.channel, _GuardedChannel)
        ):
            notes.chunks_direct = True

    def finish(self) -> None:
        Request.finish(self)
        notes = self._notes
        notes.on_lost = None
        if notes.access_to is not None:
            self._ended(True)

    def connectionLost(self, reason: Failure) -> None:
        Request.connectionLost(self, reason)
        notes = self._notes
        lost, notes.on_lost = notes.on_lost, None
        for callback in lost or ():
            try:
                callback(reason)
            except Exception:
                log.failure("while telling that a client went away")
        if notes.access_to is not None and not self.finished:
            self._ended(False)

    def _ended(self, completed: bool) -> None:
        """The response is finished, or the client went away before."""
        notes = self._notes
        site = notes.access_to
        if notes.logged or site is None:
            return
        notes.logged = True
        assert notes.received_at is not None
        site.access_later(
            (
                self,
                notes.received_at,
                notes.first_byte_at,
                site.reactor.seconds(),
                completed,
            )
        )

    def process(self) -> None:
        # Twisted's Request.process, but the Date header comes from the
        # site's clock and is formatted once a second, not from the wall
        # clock on every request (time.gmtime and string formatting).
        site = self.site = self.channel.site  # type: ignore[attr-defined]
        out = self.responseHeaders._rawHeaders  # (nvproxy.proxy.headers)
        out[SERVER] = [server_version]
        out[DATE] = [_http_date(int(site.reactor.seconds()))]
        self.prepath = []
        self.postpath = list(map(unquote, self.path[1:].split(b"/")))
        if self.path == b"*":
            self._handleStar()  # type: ignore[no-untyped-call]
            return
        try:
            found = site.getResourceFor(self)
            if _IEncodingResource.providedBy(found):
                encoder = found.getEncoder(self)
                if encoder is not None:
                    self._encoder = encoder
            self.render(found)  # type: ignore[no-untyped-call]
        except BaseException:
            self.processingFailed(Failure())  # type: ignore[no-untyped-call]


_REQUEST_ATTRIBUTES = (
    # What a facade request sets on itself over its life, in the order it
    # does: __init__'s,
    "notifications",
    "channel",
    "client",
    "host",
    "requestHeaders",
    "responseHeaders",
    "transport",
    "_notes",
    # the head's and the body's,
    "content",
    "args",
    "method",
    "uri",
    "clientproto",
    "path",
    "received_cookies",  # a client that sends cookies
    # process's and the resource's,
    "site",
    "prepath",
    "postpath",
    "sitepath",
    "code",
    "code_message",
    "streamingProducer",
    "producer",
    # the answer's.
    "startedWriting",
    "sentLength",
    "chunked",
    "finished",
    "_disconnected",
    # (Not "write", which twisted.web sets to a no-op to answer a HEAD, a
    # 204 or a 304: a method's name in the table makes CPython look every
    # request.write() call up the slow way.  The last room goes to a name
    # only a resource without render_HEAD sets, so that "write" never
    # gets in: such an answer has a dict of its own instead.)
    "_inFakeHead",
)
"""
What a facade request sets on itself, but for the rare ways out.  As for
the channel (L{_CHANNEL_ATTRIBUTES}): CPython 3.11 keeps an instance's
attributes beside it, keyed by a table its class's instances share, only
while the class has seen at most 30 names (29 with the seed below), and
a request that sets one more gets a dict of its own, whose every read is
slower.  twisted.web's request and nvproxy's set 36 names to answer a
chat and 38 a stream, so the names that are the same for every request
are on the class (L{FacadeRequest.__init__}), nvproxy's own are one
attribute (L{_Notes}), and the class is seeded with these names at import.
"""

_seed_shared_keys(FacadeRequest, _REQUEST_ATTRIBUTES)


def _is_whole(length: list[bytes], sent: int) -> bool:
    """Whether C{sent} body bytes are all that a C{Content-Length} of
    C{length} announces (never when it is not one decimal number)."""
    return len(length) == 1 and length[0].isdigit() and sent >= int(length[0])


@lru_cache(maxsize=1)
def _http_date(second: int) -> bytes:
    """The HTTP date of C{second} (seconds since the epoch)."""
    date: bytes = datetimeToString(second)
    return date


def when_lost(request: Any, callback: Callable[[Failure], object]) -> None:
    """
    Call C{callback(reason)} if C{request}'s client goes away before the
    answer is finished: C{request.notifyFinish().addErrback(callback)},
    without the Deferred and its callbacks for a facade request (two per
    proxied request, each fired for nothing when the answer finishes).
    """
    if isinstance(request, FacadeRequest):
        notes = request._notes
        if notes.on_lost is None:
            notes.on_lost = [callback]
        else:
            notes.on_lost.append(callback)
        return
    request.notifyFinish().addErrback(callback)


def _site(request: Request) -> FacadeSite:
    site = request.channel.site  # type: ignore[attr-defined]
    assert isinstance(site, FacadeSite)
    return site


class _CountedChannel(_GuardedChannel):
    site: FacadeSite

    def connectionMade(self) -> None:
        self.site.connections += 1
        self.site.channels.add(self)
        _GuardedChannel.connectionMade(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.site.connections -= 1
        self.site.channels.discard(self)
        _GuardedChannel.connectionLost(self, reason)
        if not self.site.channels:
            waiters, self.site.closed_waiters = self.site.closed_waiters, []
            for waiter in waiters:
                waiter.callback(None)


class _Overloaded(Protocol):
    def __init__(self, body: bytes) -> None:
        self._body = body

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\n"
            b"Content-Type: application/json\r\n"
            b"Retry-After: 1\r\n"
            b"Content-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % len(self._body) + self._body
        )
        self.transport.loseConnection()


class FacadeSite(GuardedSite):
    """
    A site for one facade port.
    """

    protocol = _CountedChannel
    requestFactory = FacadeRequest
    noisy = False

    def __init__(
        self,
        resource: IResource,
        *,
        error_body: Callable[[int, str], bytes],
        max_body: int,
        max_connections: int,
        limits: ClientLimits = ClientLimits(),
        reactor: Any = None,
        access_log: bool = False,
    ) -> None:
        GuardedSite.__init__(
            self, resource, error_body=error_body, limits=limits, reactor=reactor
        )
        self.max_body = max_body
        self.max_connections = max_connections
        self.connections = 0
        self.access_log = access_log
        self.channels: set[_CountedChannel] = set()
        self.closed_waiters: list[Deferred[None]] = []
        self._access_lines: list[AccessLine] = []

    def access_later(self, line: AccessLine) -> None:
        """
        Log one request's access line (L{emit}'s arguments) on the next
        reactor turn, with every other line of this turn (one timer, one
        write for them all).  Not at once: a proxy error finishes the
        response inside the dispatcher's call, and the facade notes the
        job's node and attempts just after.
        """
        lines = self._access_lines
        lines.append(line)
        if len(lines) == 1:
            self.reactor.callLater(0, self._write_access_lines)

    def _write_access_lines(self) -> None:
        lines, self._access_lines = self._access_lines, []
        with batched():
            for line in lines:
                emit(*line)

    def close_connections(self) -> Deferred[None]:
        """
        Close every client connection once its buffered bytes are written
        (shutdown); fires when the last one is gone.
        """
        if not self.channels:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self.closed_waiters.append(waiter)
        for channel in list(self.channels):
            if channel.transport is not None:
                channel.transport.loseConnection()
        return waiter

    def buildProtocol(self, addr: IAddress | None) -> Any:
        if self.connections >= self.max_connections:
            log.warn(
                "connection limit {limit} reached, refusing a client",
                limit=self.max_connections,
            )
            return _Overloaded(self.error_body(503, "too many connections"))
        return GuardedSite.buildProtocol(self, addr)

    def log(self, request: Any) -> None:
        # Access logging goes through the facade's structured events.
        pass
