"""
The chaos soak: C{python -m bench.soak}.  Fault-injecting engine doubles on
asyncio (L{bench.soak.engine}), a raw-HTTP load generator that can walk away
(L{bench.soak.client}), per-request checks against spec §5.4
(L{bench.soak.checks}) and the run with its summary table
(L{bench.soak.run}).  See C{bench/README.rst}, "Chaos soak".
"""
