# -*- test-case-name: tests.test_listener -*-
"""
IP addresses as nvproxy reads them: the one loopback check, for configured
hosts and for connected peers alike.
"""

from __future__ import annotations

import ipaddress

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.interfaces import IAddress

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def ip_of(host: str) -> IP | None:
    """
    The IP address C{host} names (C{localhost} is 127.0.0.1), or C{None}.
    An IPv4-mapped IPv6 address (what a dual-stack listener sees of an IPv4
    client) is its IPv4 address: C{ipaddress} says C{::ffff:127.0.0.1} is
    not loopback.
    """
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def is_loopback_host(host: str) -> bool:
    """Whether C{host} (an IP literal or C{localhost}) is a loopback address."""
    address = ip_of(host)
    return address is not None and address.is_loopback


def is_loopback(address: IAddress) -> bool:
    """
    Is C{address} a loopback IP address (127.0.0.0/8, ::1, ::ffff:127.x.x.x)?

    Anything that is not an IPv4 or IPv6 address (a UNIX socket, an unparsable
    host) is not loopback: the plaintext personality is opened only to what is
    certainly this machine over IP.
    """
    if not isinstance(address, IPv4Address | IPv6Address):
        return False
    return address.host != "localhost" and is_loopback_host(address.host)
