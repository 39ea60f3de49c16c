# -*- test-case-name: tests.test_config -*-
"""
The command line of C{twistd nvproxy}: one option per flag of the settings
table, the configuration loaded after parsing, and twistd's log observer
chosen from it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

from twisted.python import usage

from nvproxy.config._load import load_config
from nvproxy.config._parse import ConfigError
from nvproxy.config._settings import FLAG_NAMES, option_parameters
from nvproxy.config._values import Config
from nvproxy.logs import configure_twistd


def _exit(lines: str) -> NoReturn:
    """
    Stop twistd with each line as C{nvproxy: <line>}, not its whole usage
    text.
    """
    for line in lines.splitlines():
        print(f"nvproxy: {line}", file=sys.stderr)
    raise SystemExit(2)


class Options(usage.Options):
    """
    Command-line options of C{twistd nvproxy}.  After parsing, C{self.config}
    holds the loaded L{Config}.

    Parsed by twistd (a C{parent} is set), a problem prints one line per
    problem to stderr and exits with status 2; otherwise it is a
    L{usage.UsageError} with those lines.  Under twistd, C{--log-format} and
    C{--log-level} also choose twistd's own log observer, which must be set
    while options are parsed (twistd starts logging before it calls
    C{makeService}); with C{--control stdio} it logs to stderr, as stdout
    carries the broker link.
    """

    synopsis = "[options]"
    longdesc = (
        "Reverse-proxy LLM inference for Ollama, LM Studio, llama.cpp and vLLM. "
        "Every option also reads NVPROXY_<OPTION> from the environment "
        "(e.g. NVPROXY_RESPONSE_HEADER_TIMEOUT); options win over the "
        "environment, which wins over the config file."
    )
    optParameters = option_parameters()
    optFlags = [
        [
            "check",
            None,
            "Validate the configuration, print every problem and exit"
            " (status 0 when valid, 2 otherwise); start nothing.",
        ]
    ]

    config: Config

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._env: Mapping[str, str] = os.environ if env is None else env

    def _parent(self) -> Any:
        return getattr(self, "parent", None)

    def parseOptions(self, options: Any = None) -> None:
        try:
            super().parseOptions(options)  # type: ignore[no-untyped-call]
        except usage.UsageError as e:
            if self._parent() is None:
                raise
            _exit(f"{e} (see twistd nvproxy --help)")

    def postOptions(self) -> None:
        flags: dict[str, str | None] = {name: self[name] for name in FLAG_NAMES}
        parent = self._parent()
        try:
            self.config = load_config(self["config"], flags, self._env)
        except ConfigError as e:
            if parent is None:
                raise usage.UsageError(str(e)) from None
            # The flags were fine, their values were not: no pointer to --help.
            _exit(str(e))
        if self["check"]:
            where = self["config"] or "flags and environment"
            print(f"nvproxy: configuration OK ({where})")
            raise SystemExit(0)
        if parent is not None and not parent.get("logger"):
            parent["logger"] = configure_twistd(
                self.config.log_format,
                self.config.log_level,
                parent.get("logfile"),
                bool(parent.get("nodaemon")),
                stderr=self.config.control == "stdio",
            )
