# -*- test-case-name: tests.test_vllm -*-
"""
The sleep-aware vLLM backend (DESIGN §4, FD §6): which service serves a
model, waking a sleeping service on demand, putting idle ones back to sleep,
and a dispatch L{Target} that holds a request until its service is awake.

Pieces:

* L{VllmRegistry}: model / alias (case-insensitive) and default routes to a
  L{VllmServiceConfig} (FD §6.1, §6.2 step 1).
* L{VllmManager}: a twisted C{Service} running one state machine per vLLM
  service over treq; single-flight wake, depth-aware holds, tiered idle sleep,
  persisted wake intent (FD §6.2-§6.4), admin control (FD §6.5).
* L{WakingTarget}: wraps the dispatch target of a local vLLM service.

Modules: C{_registry} (models, defaults), C{_errors} (depths, the 503
body), C{_machine} (the per-service state machine and its treq driver of
the sleep API), C{_manager} (the service, persistence, metrics, admin
routes), C{_target} (the dispatch target).

The per-service machine (an Automat TypeMachine; each state's data owns
what its exits cancel)::

    state     [data]             input           -> next state
    unknown   -                  need            -> waking
                                 restore(level)  -> asleep      (startup)
                                 begin_sleep     -> sleeping    (admin)
    awake     [idle timer]       need            -> waking      (state_ttl passed:
                                                                 re-check)
                                 idle_due        -> awake | begin_sleep
                                 begin_sleep     -> sleeping
    asleep    [escalation timer] need            -> waking
                                 idle_due        -> asleep | begin_sleep(2)
                                 begin_sleep     -> sleeping
    waking    [wake op]          need            -> waking      (join the wake)
                                 woke            -> awake       (holds released)
                                 wake_failed     -> asleep      (holds: WakeFailed)
                                 unreachable     -> down        (holds: WakeFailed)
    sleeping  [sleep op, reply]  need            -> sleeping    (woken after)
                                 slept(level)    -> asleep      (-> waking if held)
                                 sleep_failed    -> unknown     (-> waking if held)
    down      -                  need            -> waking
    any       ...                stop            -> stopped     (ops cancelled,
                                                                 timers cancelled,
                                                                 holds fail)

    admin sleep(level): refused (409) in waking, sleeping, down, or with
    active requests; a no-op when already asleep at least that deep.

Held requests (L{_Hold}: a Deferred and its hold timer) belong to the
service, not to a state: they outlive the hop sleeping -> asleep -> waking.

Decisions where FD and DESIGN are silent:

* Freshness: an awake service is trusted without any HTTP call while the
  evidence is at most C{state_ttl} old.  Evidence is a finished wake or check,
  and every request that ends with an answer from the service below 500.  A
  request after a longer quiet spell re-checks once (C{GET /is_sleeping},
  C{GET /health}) in case somebody slept the service directly (port 8001).
  C{state_ttl=math.inf} never re-checks.
* The wake sequence (FD §6.2 step 3) also polls C{/is_sleeping} after
  C{POST /wake_up} until it reports false, so a vLLM whose C{/wake_up}
  answers before the wake completes never gets C{reload_weights} too early.
  Every attempt starts with C{GET /is_sleeping} (FD §6.4): a service that
  is awake only has its C{/health} polled, a wake already running at the
  service is joined (vLLM serializes C{/wake_up}), never doubled.
* C{/is_sleeping} answering 404 (no dev mode) is read as "not sleeping".
* Unreachable (connection refused, 502/503/504 from C{/is_sleeping}): the
  depth becomes C{restarting} (holds are extended to 300 s), C{/health} is
  polled until 200 for up to C{wake_timeout}; past that the service is
  C{down} and the next request starts over.  A down service is not "retried
  once": the poll is the retry.
* A failed wake attempt (error status, or not ready within C{wake_timeout})
  is retried once at once; then the held callers get L{WakeFailed} (a
  L{Waking}: the depth-aware 503 of FD §6.2.1) and the service is
  C{asleep} at the depth it had.
* After an nvproxy restart a persisted depth is trusted (it came from our own
  C{/sleep}); with no record the depth is unknown and counts as offloaded.
* Level 1 -> 2 escalation sends C{POST /sleep?level=2} to the level-1
  sleeper.  If that answers an error, or with C{escalate_by_wake=True}, it
  wakes the service (C{/wake_up}, no reload) and sleeps it at level 2.
* Admin sleep is refused (L{Refused}, 409) with active requests, while a
  wake or a sleep is in progress, and when the service is down; sleeping a
  service already asleep at that level or deeper is a no-op.
* A completed wake (or re-check) restarts the idle clock, so a service
  whose held callers gave up is not put back to sleep the moment it wakes.
  C{POST /sleep} always carries C{mode=wait}.
* C{estimated_wake_seconds}: the last measured wake of that depth for that
  service (defaults 6 / 45 / 300 s) minus the time this wake has already
  taken, at least 1.
"""

from nvproxy.vllm._errors import (
    Depth,
    ManagerStopped,
    ModelRequired,
    Refused,
    UnknownModel,
    UnknownService,
    WakeFailed,
    Waking,
    waking_503_body,
)
from nvproxy.vllm._manager import STATE_FILE, VllmManager, admin_routes
from nvproxy.vllm._registry import MULTIPART_PREFIX, VllmRegistry
from nvproxy.vllm._target import WakingTarget

__all__ = [
    "MULTIPART_PREFIX",
    "STATE_FILE",
    "Depth",
    "ManagerStopped",
    "ModelRequired",
    "Refused",
    "UnknownModel",
    "UnknownService",
    "VllmManager",
    "VllmRegistry",
    "WakeFailed",
    "Waking",
    "WakingTarget",
    "admin_routes",
    "waking_503_body",
]
