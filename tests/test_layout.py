"""
The package's layout keeps its promises: every module names a test module
that exists in its C{test-case-name} header, and nvproxy's modules import
each other without a cycle.

Both checks read the source (L{ast}), so a failure names every offender at
once instead of the first import that breaks.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import nvproxy

PACKAGE = Path(nvproxy.__file__).parent
ROOT = PACKAGE.parent
HEADER = re.compile(r"^# -\*- test-case-name: (?P<names>[\w.,\s]+?) -\*-$")


def modules(package: Path = PACKAGE) -> Iterator[tuple[str, Path]]:
    """Every module of C{package}: (dotted name, path)."""
    root = package.parent
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _has_code(tree: ast.Module) -> bool:
    """
    Anything to test: more than a docstring, C{from __future__} imports and
    constants (C{__version__ = "..."}).
    """
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(
            node.value, ast.Constant
        ):
            continue
        return True
    return False


def header_problems(package: Path = PACKAGE) -> list[str]:
    """
    Modules whose first line is not a C{test-case-name} header naming test
    modules that exist.  A module with nothing to test (a package's
    C{__init__} with a docstring and a version) needs none.
    """
    root = package.parent
    problems = []
    for name, path in modules(package):
        source = path.read_text(encoding="utf-8")
        first = source.split("\n", 1)[0]
        match = HEADER.match(first)
        if match is None:
            if _has_code(ast.parse(source)):
                problems.append(f"{name}: no test-case-name header")
            continue
        for test in re.split(r"[,\s]+", match["names"].strip()):
            if not (root / Path(*test.split("."))).with_suffix(".py").is_file():
                problems.append(f"{name}: names {test}, which does not exist")
    return problems


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level(
    body: list[ast.stmt], typing: bool
) -> Iterator[ast.Import | ast.ImportFrom]:
    """
    The imports a module runs when it is imported: its body's, including
    those under C{try} and C{if}, not those in functions or classes, which
    run later.  Those under C{if TYPE_CHECKING:} only with C{typing}.
    """
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if typing or not _is_type_checking(node.test):
                yield from _top_level(node.body, typing)
            yield from _top_level(node.orelse, typing)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _top_level(block, typing)
            for handler in node.handlers:
                yield from _top_level(handler.body, typing)


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    """
    Module -> the nvproxy modules it imports at import time (with
    C{typing}, also those it imports for type checking only).  C{from a.b
    import c} depends on C{a.b.c} when that is a module, else on C{a.b};
    a package's C{__init__} is not counted as a dependency of its own
    submodules' imports of each other.
    """
    known = dict(modules())
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _top_level(tree.body, typing):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = []
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in known else base)
            for target in targets:
                if target in known and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """
    The strongly connected components with more than one module (Tarjan),
    each sorted, in sorted order.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


class HeaderTests(SynchronousTestCase):
    def test_headers_name_existing_test_modules(self) -> None:
        """
        Each module's first line is C{# -*- test-case-name: tests.test_x -*-}
        and C{tests/test_x.py} exists, so C{trial --testmodule} finds them.
        """
        self.assertEqual(header_problems(), [])

    def test_problems_are_found(self) -> None:
        """
        The check names a module without a header and a header naming a
        missing test module; an C{__init__} with nothing to test, a header
        naming existing modules (one or several) pass.
        """
        root = Path(self.mktemp())
        (root / "pkg").mkdir(parents=True)
        (root / "tests").mkdir()
        (root / "tests" / "test_a.py").write_text("")
        (root / "tests" / "test_b.py").write_text("")
        files = {
            "__init__.py": '"""A package."""\n__version__ = "1"\n',
            "a.py": "# -*- test-case-name: tests.test_a -*-\nX = len('')\n",
            "b.py": "# -*- test-case-name: tests.test_a, tests.test_b -*-\n",
            "c.py": "# -*- test-case-name: tests.test_gone -*-\n",
            "d.py": '"""No header."""\ndef f() -> None: ...\n',
        }
        for name, text in files.items():
            (root / "pkg" / name).write_text(text)
        self.assertEqual(
            header_problems(root / "pkg"),
            [
                "pkg.c: names tests.test_gone, which does not exist",
                "pkg.d: no test-case-name header",
            ],
        )


class ImportCycleTests(SynchronousTestCase):
    def test_no_import_cycle(self) -> None:
        """
        No nvproxy module imports, at import time, a module that imports it
        back (directly or through others).
        """
        self.assertEqual(cycles(import_graph()), [])

    def test_no_cycle_through_type_imports(self) -> None:
        """
        Nor through imports made only for type checking (C{if
        TYPE_CHECKING:}): a type-only edge back still couples two modules
        that should depend one way.
        """
        self.assertEqual(cycles(import_graph(typing=True)), [])

    def test_cycles_are_found(self) -> None:
        """The check itself finds a cycle, and only the modules on it."""
        graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
        self.assertEqual(cycles(graph), [["a", "b", "c"]])
        self.assertEqual(cycles({"a": {"b"}, "b": set()}), [])

    def test_graph_reads_imports(self) -> None:
        """
        The graph has the edges a reader sees: the dispatcher imports the
        engine table; nothing imported only for type checking or inside a
        function counts.
        """
        graph = import_graph()
        self.assertIn("nvproxy.engines", graph["nvproxy.discovery"])
        self.assertNotIn("nvproxy.service", graph["nvproxy.discovery"])
        for name, edges in graph.items():
            self.assertNotIn(name, edges)
        # TYPE_CHECKING imports appear only in the typing graph.
        typed = import_graph(typing=True)
        for name, edges in graph.items():
            self.assertLessEqual(edges, typed[name])
