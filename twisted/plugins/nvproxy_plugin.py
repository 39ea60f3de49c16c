"""
The twistd plugin: C{twistd -n nvproxy [options]}.
"""

from twisted.application.service import ServiceMaker

nvproxy = ServiceMaker(
    "nvproxy",
    "nvproxy.service",
    "Carry LLM inference to the node that should serve it.",
    "nvproxy",
)
