"""
The request path: listener (first-byte demux, access gate, peer
personality) -> site -> facade -> dispatch -> attempt -> upstream; see
docs/architecture.rst.
"""
