"""
nvproxy's trial suite.

Loads one Hypothesis profile that works under trial (as Twisted's own suite
does): no per-example deadline, no too-slow health check, derandomized so a
run is reproducible.
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "nvproxy",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("nvproxy")
