# -*- test-case-name: tests.test_pathnorm -*-
"""
Caches for pure functions of a request's bytes (a path, a header value): a
client sends the same few over and over, and may send anything.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, wraps
from typing import TypeVar

__all__ = ["SHORT", "keep_short"]

T = TypeVar("T")

SHORT = 256
"""Inputs up to this many bytes have their results kept."""


def keep_short(
    maxsize: int, longest: int = SHORT
) -> Callable[[Callable[[bytes], T]], Callable[[bytes], T]]:
    """
    An LRU cache of C{maxsize} results for a pure function of one C{bytes}
    argument, kept only for inputs of at most C{longest} bytes (longer ones
    are computed each time, so a client cannot fill the cache with large
    keys).  A result is shared by every caller: it must not be mutated.
    """

    def wrap(function: Callable[[bytes], T]) -> Callable[[bytes], T]:
        cached = lru_cache(maxsize=maxsize)(function)

        @wraps(function)
        def call(raw: bytes) -> T:
            if len(raw) <= longest and type(raw) is bytes:
                return cached(raw)
            return function(raw)

        return call

    return wrap
