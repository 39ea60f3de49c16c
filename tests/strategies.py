"""
Shared Hypothesis strategies.
"""

from __future__ import annotations

from hypothesis import strategies as st

from nvproxy.dispatch import DispatchPolicy, FailureKind, StreamEnd

# -- dispatch (tests.test_dispatch) ----------------------------------------

Action = tuple[object, ...]
"""
One step of a generated fault schedule for a dispatch job:

  - C{("advance", seconds)}: move the clock;
  - C{("fail", kind, status)}: the newest pending attempt fails;
  - C{("respond", status)}: the newest pending attempt gets a status (it
    commits it when final or not retryable, like the real attempt);
  - C{("claim",)} / C{("deliver",)}: two halves of a commit (first byte
    arrived / result delivered), so a discovery loss can race it;
  - C{("end", how)}: the committed copy ends;
  - C{("discovery", nodes)}: the live snapshot becomes these node indexes;
  - C{("cancel",)}: the client goes away; C{("shutdown",)}.
"""


def dispatch_policies() -> st.SearchStrategy[DispatchPolicy]:
    return st.builds(
        DispatchPolicy,
        max_attempts=st.integers(min_value=1, max_value=6),
        deadline=st.sampled_from([3.0, 30.0, 600.0]),
        backoff=st.lists(
            st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0]), min_size=0, max_size=3
        ).map(lambda delays: (*delays, 4.0)),
        jitter=st.sampled_from([0.0, 0.2, 0.5]),
        retry_after=st.integers(min_value=0, max_value=30),
    )


def dispatch_actions(nodes: int) -> st.SearchStrategy[Action]:
    statuses = st.sampled_from([200, 204, 302, 400, 404, 408, 429, 500, 503])
    return st.one_of(
        st.tuples(
            st.just("advance"),
            st.sampled_from([0.1, 0.5, 1.0, 5.0, 60.0, 240.0, 700.0]),
        ),
        st.tuples(
            st.just("fail"),
            st.sampled_from(
                [FailureKind.TRANSPORT, FailureKind.NO_CONTENT, FailureKind.TARGET_LOST]
            ),
            st.none(),
        ),
        st.tuples(st.just("respond"), statuses),
        st.tuples(st.just("claim")),
        st.tuples(st.just("deliver")),
        st.tuples(st.just("end"), st.sampled_from(list(StreamEnd))),
        st.tuples(
            st.just("discovery"),
            st.frozensets(st.integers(min_value=0, max_value=nodes - 1)),
        ),
        st.tuples(st.just("discovery"), st.just(frozenset[int]())),
        st.tuples(st.just("cancel")),
        st.tuples(st.just("shutdown")),
    )


@st.composite
def dispatch_schedules(
    draw: st.DrawFn,
) -> tuple[DispatchPolicy, bool, int, frozenset[int], list[Action], list[float]]:
    """
    A policy, the inference flag, the number of nodes, the node indexes in
    discovery at admission, a fault schedule, and the samples the injected
    random source returns.
    """
    policy = draw(dispatch_policies())
    inference = draw(st.booleans())
    nodes = draw(st.integers(min_value=1, max_value=3))
    # Usually every node at admission; sometimes a subset, or nobody.
    initial = draw(
        st.one_of(
            st.just(frozenset(range(nodes))),
            st.frozensets(st.integers(min_value=0, max_value=nodes - 1)),
        )
    )
    actions = draw(st.lists(dispatch_actions(nodes), max_size=30))
    samples = draw(
        st.lists(
            st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
            min_size=1,
            max_size=5,
        )
    )
    return policy, inference, nodes, initial, actions, samples
