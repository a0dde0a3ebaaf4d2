#!/usr/bin/env python3
# A copy of ../shared/tools/loc.py (the team's size tool), so that CI on a bare clone can run it.
"""Size of a Python tree per folder: code lines, code tokens, logic tokens, lines over 100 columns,
and the size of the audit path (the code a token passes from sampling to gradient).

Usage: loc.py [ROOT] [--budget-core N]   (ROOT: a folder or one file; defaults to ./workbench)

- code tokens leave out comments, docstrings and bare string statements;
- logic tokens are code tokens less type annotations (of parameters, returns and annotated
  assignments, with their ':' and '->'): types document code and cost nothing at run time, so
  they never count against a budget, nor do the statements that exist only for them (an
  `if TYPE_CHECKING:` block, `from __future__ import annotations`);
- the audit path is the set of files in CORE below (both the flat and the winged layout); its
  logic tokens are the size a reviewer must read to check the three invariants.
Prints one row per sub-folder, the largest files, the totals and the audit path; exits 1 when the
audit path's logic tokens are over --budget-core.
"""
import ast
import bisect
import io
import sys
import tokenize
from pathlib import Path

SKIP = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
        tokenize.ENDMARKER)

# The audit path, relative to ROOT: a file, or a folder ending in '/'. Both layouts are listed.
CORE = (
    "segment.py", "invariants/", "algo/", "server/", "engines/",
    "rollout.py", "rollout/", "learner.py", "batch.py", "sharding.py", "transport.py", "learner/",
    "loop.py", "window.py", "run/loop.py", "run/window.py",
    "models/packing.py", "models/prefix.py",
)
NOT_CORE = ("server/serve.py", "learner/sft.py")


def annotation_spans(src: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions of every annotation in the source, the ':' or '->' not included."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    nodes = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p]
            nodes += [p.annotation for p in params if p.annotation is not None]
            if node.returns is not None:
                nodes.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            nodes.append(node.annotation)
    return [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in nodes]


def is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def typing_only_spans(src: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions of the statements that exist only for annotations: an
    `if TYPE_CHECKING:` block, `from __future__ import annotations` and the import of
    TYPE_CHECKING itself."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    nodes = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and is_type_checking(node.test) and not node.orelse:
            nodes.append(node)
        elif isinstance(node, ast.ImportFrom) and (
            (node.module == "__future__" and [a.name for a in node.names] == ["annotations"])
            or (node.module == "typing" and [a.name for a in node.names] == ["TYPE_CHECKING"])):
            nodes.append(node)
    return [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in nodes]


def measure(path: Path) -> tuple[int, int, int, int]:
    """(code lines, code tokens, annotation tokens, physical lines over 100 characters)."""
    try:
        src = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return 0, 0, 0, 0
    wide = sum(1 for line in src.splitlines() if len(line) > 100)
    lines: set[int] = set()
    starts: list[tuple[int, int]] = []
    kinds: list[str] = []
    prev = tokenize.NEWLINE
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type in SKIP:
                if tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                    prev = tok.type
                continue
            # a string that starts a logical line is a docstring or a bare string statement
            if tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT,
                                                         tokenize.DEDENT):
                prev = tokenize.STRING
                continue
            prev = tok.type
            starts.append(tok.start)
            kinds.append(tok.string)
            lines.update(range(tok.start[0], tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        code = [line for line in src.splitlines() if line.strip() and not line.strip().startswith("#")]
        return len(code), sum(len(line.split()) for line in code), 0, wide
    annotated = 0
    for start, end in annotation_spans(src):
        i = bisect.bisect_left(starts, start)
        j = bisect.bisect_left(starts, end)
        # the annotation's own tokens, and the ':' or '->' just before it
        annotated += (j - i) + (1 if i > 0 and kinds[i - 1] in (":", "->") else 0)
    for start, end in typing_only_spans(src):
        annotated += bisect.bisect_left(starts, end) - bisect.bisect_left(starts, start)
    return len(lines), len(starts), annotated, wide


def in_core(rel: str) -> bool:
    if any(rel == n or rel.startswith(n) for n in NOT_CORE):
        return False
    return any(rel == c or (c.endswith("/") and rel.startswith(c)) for c in CORE)


def main(argv: list[str]) -> int:
    budget = None
    args = list(argv)
    for flag in ("--budget-core", "--budget-tokens"):
        if flag in args:
            i = args.index(flag)
            budget = int(args[i + 1])
            del args[i:i + 2]
    root = Path(args[0]) if args else Path("workbench")
    if not root.exists():
        print(f"loc: {root} does not exist")
        return 0
    groups: dict[str, list[int]] = {}
    files: list[tuple[int, str]] = []
    core = [0, 0]  # files, logic tokens
    paths = [root] if root.is_file() else sorted(root.rglob("*.py"))
    for f in paths:
        n_lines, n_tokens, n_ann, n_wide = measure(f)
        rel = f.relative_to(root) if root.is_dir() else Path(f.name)
        key = str(rel.parts[0]) if len(rel.parts) > 1 else "(top)"
        g = groups.setdefault(key, [0, 0, 0, 0])
        for k, v in enumerate((n_lines, n_tokens, n_tokens - n_ann, n_wide)):
            g[k] += v
        files.append((n_tokens - n_ann, str(f)))
        if root.is_dir() and in_core(rel.as_posix()):
            core[0] += 1
            core[1] += n_tokens - n_ann
    print(f"{'lines':>7} {'tokens':>8} {'logic':>8} {'>100col':>8}  folder")
    for k, (n_lines, n_tokens, n_logic, n_wide) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{n_lines:7d} {n_tokens:8d} {n_logic:8d} {n_wide:8d}  {root}/{k}")
    print("largest files (logic tokens): "
          + ", ".join(f"{p} {t}" for t, p in sorted(files, reverse=True)[:5]))
    total = [sum(g[k] for g in groups.values()) for k in range(4)]
    print(f"total in {root}: {total[0]} code lines, {total[1]} code tokens, {total[2]} logic tokens "
          f"({total[1] - total[2]} in annotations), {total[3]} lines over 100 columns")
    if root.is_dir():
        line = f"audit path: {core[0]} files, {core[1]} logic tokens"
        if budget is not None:
            line += f" (budget {budget})"
        print(line)
        if budget is not None and core[1] > budget:
            print(f"over budget by {core[1] - budget} logic tokens on the audit path")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
