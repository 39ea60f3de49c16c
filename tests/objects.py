"""How CPython lays out an object's attributes, for tests of hot objects."""

from __future__ import annotations

import gc


def keeps_own_dict(obj: object) -> bool:
    """
    Whether CPython keeps C{obj}'s attributes in a dict of its own rather
    than beside it, keyed by its class's shared table: asking for
    C{__dict__} (C{vars}) switches an object to a dict for good, and every
    later attribute read of it is slower.  The dict is then among what the
    object refers to; this asks for it only after looking (so the object
    has one afterwards either way).
    """
    referents = gc.get_referents(obj)
    own = vars(obj)
    return any(r is own for r in referents)
