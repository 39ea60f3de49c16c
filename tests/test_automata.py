"""
L{nvproxy.automata.indexed}: the dict lookup gives every machine the
transitions Automat's own scan gives.
"""

from __future__ import annotations

from typing import Any, Protocol

from automat import TypeMachineBuilder
from automat._core import Automaton, NoTransition
from twisted.trial.unittest import SynchronousTestCase

from nvproxy import dispatch, shutdown
from nvproxy.automata import indexed
from nvproxy.etcd import _session
from nvproxy.vllm import _machine


def _answer(lookup: Any, state: Any, symbol: Any) -> object:
    try:
        to, outputs = lookup(state, symbol)
    except NoTransition:
        return "no transition"
    return to, list(outputs)


class _Inputs(Protocol):
    def go(self) -> None: ...

    def stop(self) -> None: ...


class _Core:
    pass


class IndexedTests(SynchronousTestCase):
    def test_same_transitions_as_automat(self) -> None:
        """
        For every state and every input of each of nvproxy's machines, the
        index answers what Automat's scan answers (or refuses likewise).
        """
        checked = 0
        for machine in (
            dispatch._JobMachine,
            shutdown._build(),
            _session.SessionMachine,
            _machine._ServiceMachine,
        ):
            automaton = machine.__automat_automaton__  # type: ignore[attr-defined]
            self.assertIn("outputForInput", vars(automaton), "the index is installed")
            transitions = automaton._transitions
            states = {t[0] for t in transitions} | {t[2] for t in transitions}
            symbols = {t[1] for t in transitions} | {"no-such-input"}
            for state in states:
                for symbol in symbols:
                    self.assertEqual(
                        _answer(automaton.outputForInput, state, symbol),
                        _answer(
                            lambda s, i, a=automaton: Automaton.outputForInput(a, s, i),
                            state,
                            symbol,
                        ),
                    )
                    checked += 1
        self.assertGreater(checked, 100)

    def test_machine_runs_and_refuses(self) -> None:
        """
        A machine driven through the index takes its transitions, and an
        input its state does not accept still raises Automat's error.
        """
        builder = TypeMachineBuilder(_Inputs, _Core)
        a = builder.state("a")
        b = builder.state("b")
        a.upon(_Inputs.go).to(b).returns(None)
        b.upon(_Inputs.go).to(a).returns(None)
        b.upon(_Inputs.stop).to(b).returns(None)
        machine = indexed(builder.build())(_Core())
        machine.go()
        machine.stop()  # only b accepts it: the first go moved a to b
        machine.go()
        with self.assertRaises(NoTransition):
            machine.stop()  # back in a

    def test_unknown_internals_left_alone(self) -> None:
        """Something that is not a built machine comes back unchanged."""
        thing = object()
        self.assertIs(indexed(thing), thing)
