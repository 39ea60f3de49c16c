"""
nvproxy: a Twisted daemon that carries LLM inference to the node that should
serve it.
"""

__version__ = "0.1.0"
