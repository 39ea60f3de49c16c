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
body), C{_client} (the sleep API of one service over treq, each call
bounded on the injected clock), C{_machine} (the per-service state machine
and its wake and sleep sequences), C{_poll} (the state poll and the
sleep-state gauge), C{_manager} (the service, persistence, metrics, admin
routes), C{_target} (the dispatch target).  Imports go one way, top
down::

    __init__ ──► _target ──► _manager ──┬──► _poll ──┬──► _machine ──► _client
                                        │            └──► _client
                                        ├──► _machine ──► _estimates
                                        ├──► _estimates
                                        ├──► _client
                                        └──► _registry
    (_errors, which imports none of them: by __init__, _target, _manager,
    _machine and _registry; __init__ also re-exports _manager and _registry)

C{_machine} knows nothing of the manager: each service's L{_Core
<nvproxy.vllm._machine._Core>} gets the clock, the hold policy, the
metrics, its L{SleepApi <nvproxy.vllm._client.SleepApi>} client, the
settings and an on-changed callback (the manager persists the intent).

The per-service machine (an Automat TypeMachine; each state's data owns
what its exits cancel)::

    state     [data]             input           -> next state
    unknown   -                  need            -> waking
                                 check           -> checking    (startup)
                                 begin_sleep     -> sleeping    (admin)
                                 seen_awake      -> awake       (the state poll)
                                 seen_asleep     -> asleep
    checking  [check op]         found_awake     -> awake       (idle timer armed)
    (phase                       found_asleep    -> asleep      (known level kept)
     unknown)                    check_failed    -> unknown     (no tier to retry on)
                                 need            -> waking      (check cancelled)
                                 begin_sleep     -> sleeping    (check cancelled)
                                 seen_awake      -> awake       (check cancelled)
                                 seen_asleep     -> asleep      (check cancelled)
    awake     [idle timer]       need            -> waking      (state_ttl passed:
                                                                 re-check)
                                 idle_due        -> awake | begin_sleep
                                 quiet           -> awake       (timer re-armed)
                                 begin_sleep     -> sleeping
                                 seen_awake      -> awake       (evidence refreshed)
                                 seen_asleep     -> asleep      (slept behind our
                                                                 back; -> waking
                                                                 if active)
    asleep    [escalation timer] need            -> waking
                                 idle_due        -> asleep | begin_sleep(2)
                                 begin_sleep     -> sleeping
                                 seen_asleep     -> asleep      (level updated)
                                 seen_awake      -> awake       (woken behind our
                                                                 back; idle armed)
    waking    [wake op]          need            -> waking      (join the wake)
                                 woke            -> awake       (holds released)
                                 wake_failed     -> asleep      (holds: WakeFailed)
                                 unreachable     -> down        (holds: WakeFailed)
                                 recheck_failed  -> awake       (holds: WakeFailed)
    sleeping  [sleep op, reply]  need            -> sleeping    (woken after)
                                 slept(level)    -> asleep      (-> waking if held)
                                 sleep_failed    -> unknown     (-> waking if held,
                                                                 else -> checking)
    down      -                  need            -> waking
                                 seen_awake      -> awake       (back up)
                                 seen_asleep     -> asleep
    any       ...                stop            -> stopped     (ops cancelled,
                                                                 timers cancelled,
                                                                 holds fail)

    Inputs a state has no use for (check, quiet, seen_* in waking,
    sleeping and stopped) are no-ops there.

    admin sleep(level): refused (409) in waking, sleeping, down, or with
    active requests; a no-op when already asleep at least that deep.

Held requests (L{_Hold}: a Deferred and its hold timer) belong to the
service, not to a state: they outlive the hop sleeping -> asleep -> waking.

Decisions where FD and DESIGN are silent:

* Freshness: a state poll (L{nvproxy.vllm._poll}) every C{poll_interval}
  (C{discovery.poll_interval}) reads the C{vllm:engine_sleep_state} gauge
  on C{/metrics} (C{GET /is_sleeping} when the gauge is absent or
  C{/metrics} fails), so a service slept or woken directly (port 8001,
  vllmctl) is seen within one interval at no cost to requests.  Polls never
  wake and are not activity; they skip a service while nvproxy wakes or
  sleeps it, and an answer older than the last state change is dropped.
  Found asleep: C{asleep} at the gauge's level (unknown without it: the
  level known before stands, else offloaded); with requests active it is
  woken at once, and the wake holds every request still waiting for its
  answer from when it was forwarded (see L{WakingTarget}).  Found awake (no
  reload pending): C{awake}, its idle clock restarted.
* An awake service is trusted without any HTTP call while the evidence is
  at most C{state_ttl} (default 10 s) old.  Evidence is a poll that found
  it awake, a finished wake or re-check, and every request that ends with
  an answer from the service below 500 (the startup look is not: nobody
  asked for it).  With working polls the evidence never ages past the
  interval; while polls fail, a request after C{state_ttl} re-checks once
  (C{GET /is_sleeping}, C{GET /health}).  C{state_ttl=math.inf} never
  re-checks.  The TTL is kept (not removed) for that case: a failed poll is
  not evidence of sleep, so requests go on being forwarded for a bounded
  while, then pay one re-check.  A re-check that fails while the
  service has active requests does not make it down: like a failed request,
  the held callers get L{WakeFailed}, it stays awake and the next request
  checks again.
* The wake sequence (FD §6.2 step 3) also polls C{/is_sleeping} after
  C{POST /wake_up} until it reports false, so a vLLM whose C{/wake_up}
  answers before the wake completes never gets C{reload_weights} too early.
  Every attempt starts with C{GET /is_sleeping} (FD §6.4): a service that
  is awake only has its C{/health} polled, a wake already running at the
  service is joined (vLLM serializes C{/wake_up}), never doubled.  A wake
  sequence sets C{reload_pending} (persisted with the intent) before
  C{POST /wake_up}; only a successful C{reload_weights} and
  C{/reset_prefix_cache} clear it, and while it is set they run even when
  C{/is_sleeping} says false (a retried attempt, or a new nvproxy, after a
  wake that got past C{/wake_up}): never half-awake.
* One attempt lasts at most C{wake_timeout}: each call gets what is left
  of it, and the C{/is_sleeping} poll checks the deadline every pass (with
  C{health_poll} between passes, also when C{/health} answers but
  C{/is_sleeping} does not).  A sleep (with its escalation) likewise.
* C{/is_sleeping} answering 404 (no dev mode) is read as "not sleeping".
* Unreachable (connection refused, 502/503/504 from C{/is_sleeping}): the
  depth becomes C{restarting} (holds are extended to 300 s) until the probe
  ends, C{/health} is polled until 200 for up to C{wake_timeout}; past that
  the service is C{down} and the next request starts over.  A down service
  is not "retried once": the poll is the retry.
* A failed wake attempt (error status, or not ready within C{wake_timeout})
  is retried once at once; then the held callers get L{WakeFailed} (a
  L{Waking}: the depth-aware 503 of FD §6.2.1) and the service is
  C{asleep} at the depth it had.
* At startup a service with intent C{awake}/C{waking} is checked by a wake
  attempt (FD §6.4), with the persisted level as the depth while it is
  found asleep (a wake from level 1 cut by a restart stays C{sleeping},
  Retry-After 10); every other one gets one non-waking C{GET /is_sleeping}
  (also after a failed sleep): awake -> C{awake} with its idle timer (a
  rebooted vLLM boots awake whatever we persisted, FD §6.6), asleep ->
  C{asleep} with the persisted level as its depth (none: unknown, counted
  as offloaded).  Without an answer the look is repeated after the first
  idle tier until it settles (no tier: it stays C{unknown}, the next request
  wakes; the state poll settles it too).  A pending reload found awake is
  finished by a wake.
* L{VllmManager} may be started again after C{stopService}: it builds
  fresh machines and recovers from the state file like a new process
  (learned wake times are kept).
* Level 1 -> 2 escalation sends C{POST /sleep?level=2} to the level-1
  sleeper.  If that answers an error, or with C{escalate_by_wake=True}, it
  wakes the service (C{/wake_up}, no reload) and sleeps it at level 2.
* Admin sleep is refused (L{Refused}, 409) with active requests, while a
  wake or a sleep is in progress, and when the service is down; sleeping a
  service already asleep at that level or deeper is a no-op.
* A completed wake (or re-check, or startup look) restarts the idle clock,
  so a service whose held callers gave up is not put back to sleep the
  moment it wakes.  The end of the last active request re-arms the idle
  timer from then.
  C{POST /sleep} always carries C{mode=wait}.
* C{estimated_wake_seconds}: the learned wake estimate of that depth for
  that service (L{nvproxy.vllm._estimates}: an exponentially weighted
  average of measured wakes, from the first C{/wake_up} call to the first
  healthy answer, seeded with 6 / 45 / 300 s and persisted) minus the time
  this wake has already taken, at least 1.  C{Retry-After} is FD §6.2.1's
  by depth, or that estimate with C{retry_after = "estimate"}.
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
from nvproxy.vllm._manager import STATE_FILE, VllmManager
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
    "waking_503_body",
]
