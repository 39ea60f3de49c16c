# -*- test-case-name: tests.test_logs -*-
"""
Log output (spec §9).

nvproxy logs through L{twisted.logger} with structured fields.  Events carry
operational metadata only: engine, model, node, path, status, error text.
Nothing here ever sees a body, prompt, stream chunk or key material because
no call site passes one.

C{--log-format json} prints one JSON object per line (no record separator),
so the output is plain JSON Lines.
"""

from __future__ import annotations

import sys
from typing import IO

from twisted.logger import (
    FileLogObserver,
    ILogObserver,
    eventAsJSON,
    formatEventAsClassicLogText,
)


def json_observer(out: IO[str] | None = None) -> ILogObserver:
    """
    An observer writing one JSON object per line to C{out} (stdout).
    """
    stream = out if out is not None else sys.stdout
    return FileLogObserver(stream, lambda event: eventAsJSON(event) + "\n")


def text_observer(out: IO[str] | None = None) -> ILogObserver:
    stream = out if out is not None else sys.stdout
    return FileLogObserver(stream, formatEventAsClassicLogText)
