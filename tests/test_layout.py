"""The code's layout holds.

No import cycle in workbench/ (imports inside functions included), modules of one concern (at
most 400 code lines), lines of at most 100 columns, and a loop of calls."""

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "workbench"
MODULES = {
    ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
    for path in sorted(PACKAGE.rglob("*.py"))
}


def type_only_imports(tree: ast.Module) -> set[ast.AST]:
    """The import statements inside `if TYPE_CHECKING:` blocks: read by type checkers only."""
    blocks = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    ]
    return {inner for block in blocks for inner in ast.walk(block)}


def imported_modules(name: str, path: Path, types: bool = True) -> set[str]:
    """The workbench modules that module `name` imports anywhere in its body, functions included;
    with `types` false, not those imported for annotations only (`if TYPE_CHECKING:`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    skipped = set() if types else type_only_imports(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            # `from workbench.run import loop` imports the module workbench.run.loop, not a name
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found |= {target for target in targets if target in MODULES and target != name}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = len(index)
        low[node] = index[node]
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def code_lines(path: Path) -> int:
    """Lines holding code (no comment, docstring or blank line), as shared/tools/loc.py counts."""
    lines: set[int] = set()
    previous = tokenize.NEWLINE
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    starts = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type in skip | {tokenize.ENDMARKER}:
            if token.type in starts:
                previous = token.type
            continue
        is_docstring = token.type == tokenize.STRING and previous in starts
        previous = token.type
        if not is_docstring:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines)


def test_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_workbench_not_even_inside_functions():
    # an import for annotations only runs no code: it makes no cycle (the direction test below
    # counts it)
    graph = {name: imported_modules(name, path, types=False) for name, path in MODULES.items()}
    assert graph["workbench.run.loop"], "the import parser found nothing: it is broken"
    assert cycles(graph) == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_holds_one_concern_in_at_most_400_code_lines(name):
    if name == "workbench.config":  # its field docstrings are the reference of every key
        return
    assert code_lines(MODULES[name]) <= 400


def test_no_line_in_workbench_is_over_100_columns():
    wide = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in MODULES.values()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > 100
    ]
    assert wide == []


def test_the_loop_fits_on_one_screen_and_holds_no_arithmetic():
    source = MODULES["workbench.run.loop"].read_text()
    assert len(source.splitlines()) <= 60
    arithmetic = [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.BinOp, ast.AugAssign, ast.Compare, ast.UnaryOp))
    ]
    assert arithmetic == []


# the wings a token passes through and what they build on: the driver (run/) imports them, never
# the other way round
WINGS = ("rollout", "learner", "server", "engines", "models", "algo", "invariants")


def test_no_wing_of_the_audit_path_imports_the_driver():
    back = sorted(
        f"{name} imports {target}"
        for name, path in MODULES.items()
        if name.partition(".")[2].split(".")[0] in WINGS
        for target in imported_modules(name, path)
        if target.startswith("workbench.run")
    )
    assert MODULES["workbench.run.loop"] and back == []


@pytest.mark.parametrize("name", sorted(n for n, p in MODULES.items() if p.name == "__init__.py"))
def test_every_folder_says_what_lives_there(name):
    docstring = ast.get_docstring(ast.parse(MODULES[name].read_text())) or ""
    assert docstring.count(".") >= 2, (
        f"{name}: two sentences, what lives there and what changes there"
    )
