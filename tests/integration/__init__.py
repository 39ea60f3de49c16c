"""
Opt-in integration suites against real third-party engines.

Each suite is a contract mixin run twice: against the fake in
L{nvproxy.testing} (always, fast) and against the real engine (only with
C{NVPROXY_REAL_ENGINES=1} and a prepared engine; see C{tox -e real}).
"""
