# -*- test-case-name: tests.test_forwarding -*-
"""
Twisted's L{Headers} read and written without re-validating them.

C{Headers.copy()} rebuilds the copy through C{setRawHeaders}, which encodes
every name and scans every value for line breaks again.  Between two
L{Headers} the names are already canonical and the values clean, so the
table is taken as it is, each list fresh (the copy's values are its own).

The same holds for the few headers every request reads or sets under a
constant name with values nvproxy made itself (request ids, dates, the
content type it hid and puts back): each C{Headers} method call encodes the
name again, and a set scans the values, about a microsecond each.  Those
sites use the table (C{_rawHeaders}) under the name's canonical key,
computed once with L{canonical}.
"""

from __future__ import annotations

from twisted.web.http_headers import Headers

__all__ = [
    "CONNECTION",
    "CONTENT_LENGTH",
    "CONTENT_TYPE",
    "DATE",
    "HOST",
    "SERVER",
    "OwnHeaders",
    "canonical",
    "copy_headers",
]


class OwnHeaders(Headers):
    """
    Headers made for one outgoing request and used for nothing else: an
    agent completes them in place (C{Host}, a backend key) instead of
    copying them first, as it must with headers it was merely lent.
    """

    __slots__ = ()


def canonical(name: bytes) -> bytes:
    """The key L{Headers} keeps C{name} under: its canonical capitalization."""
    [(key, _)] = Headers({name: [b""]}).getAllRawHeaders()
    return key


# The names the data path reads or sets on every request, as keys.
CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, DATE, HOST, SERVER = map(
    canonical,
    (
        b"connection",
        b"content-length",
        b"content-type",
        b"date",
        b"host",
        b"server",
    ),
)


def copy_headers(headers: Headers) -> Headers:
    """C{headers.copy()}, without validating again what is already valid."""
    out = Headers()
    out._rawHeaders = {
        name: list(values) for name, values in headers._rawHeaders.items()
    }
    return out
