"""
The twistd plugin: C{twistd -n nvproxy [options]}.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twisted.application.service import IService, IServiceMaker
from twisted.plugin import IPlugin
from twisted.python import usage
from zope.interface import implementer

if TYPE_CHECKING:
    from nvproxy.config import Options


@implementer(IPlugin, IServiceMaker)
class _NvProxyMaker:
    """
    L{nvproxy.config.Options} and L{nvproxy.service.makeService}, imported
    only when twistd runs nvproxy (not while it lists its plugins).
    """

    tapname = "nvproxy"
    description = "Carry LLM inference to the node that should serve it."

    @property
    def options(self) -> type[Options]:
        from nvproxy.config import Options

        return Options

    def makeService(self, options: usage.Options) -> IService:
        from nvproxy.service import makeService

        return makeService(options)


nvproxy = _NvProxyMaker()
