# -*- test-case-name: tests.test_automata -*-
"""
Automat's machines, with the transition lookup made a dict.

Automat (25.4) finds the transition for an input by scanning every
transition of the machine and comparing C{(state, input)} pairs, whose
states compare through a generated C{__eq__}.  For the dispatcher's job
machine (25 transitions) that was four scans and 66 comparisons per
request, about 4 % of a request's CPU.  L{indexed} gives the built
machine's automaton one dict lookup instead; anything the table does not
hold (an input no state accepts) still goes to Automat's own lookup, which
raises or answers as it always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

__all__ = ["indexed"]

M = TypeVar("M")


def indexed(machine: M) -> M:
    """
    C{machine} (a built C{TypeMachine}) with a dict lookup of its
    transitions; unchanged if Automat's internals are not the ones this
    knows (a later Automat may not need it).
    """
    automaton: Any = getattr(machine, "__automat_automaton__", None)
    transitions = getattr(automaton, "_transitions", None)
    if not isinstance(transitions, set):
        return machine
    table: dict[tuple[Any, Any], tuple[Any, tuple[Any, ...]]] = {
        (state, symbol): (to, tuple(outputs))
        for state, symbol, to, outputs in transitions
    }
    if len(table) != len(transitions):
        return machine  # not a deterministic machine: leave it to Automat
    scan = automaton.outputForInput

    def outputForInput(state: Any, symbol: Any) -> tuple[Any, Sequence[Any]]:
        found = table.get((state, symbol))
        if found is None:
            return scan(state, symbol)  # type: ignore[no-any-return]
        return found[0], list(found[1])

    automaton.outputForInput = outputForInput
    return machine
