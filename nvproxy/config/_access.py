# -*- test-case-name: tests.test_access -*-
"""
The C{[access]} section (and its per-facade override C{[engines.E.access]}):
who may call a facade over plaintext HTTP, with which API keys, and how many
requests one key may have in flight (DESIGN §3a).
"""

from __future__ import annotations

import ipaddress
from typing import Final, TypeVar

from attrs import frozen

from nvproxy.config._parse import ConfigError, Parser, Raw, items, show

_T = TypeVar("_T")

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

LOOPBACK_NETWORKS: Final[tuple[IPNetwork, ...]] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)
"""The default of C{plaintext_from}: loopback only (spec §7)."""


@frozen
class AccessConfig:
    """
    One facade's access rules, as in effect.

    @ivar plaintext_from: the source networks allowed plaintext HTTP; any
        other source is refused before a byte of HTTP is read.
    @ivar api_keys_file: when set, callers must present a key listed there
        (loopback callers only with C{require_key_on_loopback}).
    @ivar max_concurrent_per_key: requests one key may have in flight; C{0}
        is unlimited.
    """

    plaintext_from: tuple[IPNetwork, ...] = LOOPBACK_NETWORKS
    api_keys_file: str | None = None
    require_key_on_loopback: bool = False
    max_concurrent_per_key: int = 0


@frozen
class AccessOverride:
    """
    C{[engines.E.access]}: each field given replaces the global one; L{None}
    keeps it.
    """

    plaintext_from: tuple[IPNetwork, ...] | None = None
    api_keys_file: str | None = None
    require_key_on_loopback: bool | None = None
    max_concurrent_per_key: int | None = None

    def over(self, base: AccessConfig) -> AccessConfig:
        """The rules in effect: C{base} with every given field replaced."""
        return AccessConfig(
            plaintext_from=_pick(self.plaintext_from, base.plaintext_from),
            api_keys_file=_pick(self.api_keys_file, base.api_keys_file),
            require_key_on_loopback=_pick(
                self.require_key_on_loopback, base.require_key_on_loopback
            ),
            max_concurrent_per_key=_pick(
                self.max_concurrent_per_key, base.max_concurrent_per_key
            ),
        )


def _pick(given: _T | None, default: _T) -> _T:
    return default if given is None else given


def parse_network(text: str) -> IPNetwork:
    """
    A network from C{"10.0.0.0/8"}, C{"fd00::/8"} or a bare address (a
    single host).  An IPv4-mapped IPv6 network (C{"::ffff:10.0.0.0/104"}) is
    its IPv4 network, since sources are matched that way.

    @raise ValueError: anything else, or host bits set.
    """
    network = ipaddress.ip_network(text.strip(), strict=True)
    if isinstance(network, ipaddress.IPv6Network):
        mapped = network.network_address.ipv4_mapped
        if mapped is not None and network.prefixlen >= 96:
            return ipaddress.ip_network(f"{mapped}/{network.prefixlen - 96}")
    return network


def _networks(value: Raw) -> tuple[IPNetwork, ...]:
    """
    An array of CIDR strings; from a flag or the environment, one string
    of comma-separated CIDRs.
    """
    raw = value.raw
    if value.text and isinstance(raw, str):
        entries = [
            Raw(part.strip(), value.key, text=True)
            for part in raw.split(",")
            if part.strip()
        ]
    else:
        entries = items(value)
    networks: list[IPNetwork] = []
    for entry in entries:
        if not isinstance(entry.raw, str):
            raise ConfigError(
                entry.key,
                f'must be a CIDR string such as "10.0.0.0/8", got {show(entry.raw)}',
            )
        try:
            network = parse_network(entry.raw)
        except ValueError as e:
            raise ConfigError(
                entry.key, f"not a network ({e}), got {show(entry.raw)}"
            ) from None
        if network not in networks:
            networks.append(network)
    return tuple(networks)


NETWORKS: Final = Parser(
    _networks, lambda nets: ", ".join(str(net) for net in nets) or "none"
)
