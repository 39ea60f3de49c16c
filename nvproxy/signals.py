# -*- test-case-name: tests.test_operations -*-
"""
Process signals, installed by the composition root once the reactor runs
(after Twisted installed its own handlers, which these replace):

* C{SIGTERM} (and C{SIGINT}, Ctrl-C): stop (the drain of
  L{nvproxy.shutdown}); a second one ends the drain at once.  Unlike
  Twisted's handler it does not re-raise the signal at exit, so a drained
  stop exits with status 0.
* C{SIGHUP}: reload the configuration (L{nvproxy.ops.Operations.reload}).
* C{SIGUSR1}: reopen the log file by name (logrotate).

Each handler only schedules its work on the reactor thread.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

from twisted.internet.error import ReactorNotRunning
from twisted.logger import Logger

from nvproxy.logs import reopen_logs
from nvproxy.shutdown import Shutdown

log = Logger()


def install_signal_handlers(
    reactor: Any, shutdown: Shutdown, reload: Callable[[], object] | None = None
) -> None:
    signalled = False

    def stop() -> None:
        nonlocal signalled
        if signalled or shutdown.draining:
            log.info("shutdown: second signal, ending the drain now")
            shutdown.force()
            return
        signalled = True
        log.info("shutdown: stopping on a signal")
        try:
            reactor.stop()
        except ReactorNotRunning:
            pass

    def reopen() -> None:
        reopen_logs()
        log.info("log files reopened (SIGUSR1)")

    def later(call: Callable[[], object]) -> Callable[[int, FrameType | None], None]:
        def handler(number: int, frame: FrameType | None) -> None:
            reactor.callFromThread(call)

        return handler

    signal.signal(signal.SIGTERM, later(stop))
    signal.signal(signal.SIGINT, later(stop))
    signal.signal(signal.SIGUSR1, later(reopen))
    if reload is not None:
        signal.signal(signal.SIGHUP, later(reload))
