"""The size measures of SPEC section 9: lines per module (``wc -l``) and lines per function
(its body, from the first statement after the docstring to its last line: the signature and
the docstring do not count).

    python -m tests.tools.code_size [ROOT] [--lines 700] [--function-lines 80]

prints the modules over ``--lines`` and the functions over ``--function-lines``, longest first.
"""

import argparse
import ast
from pathlib import Path
from typing import Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[2] / "megatron"


def module_lines(root: Path = ROOT) -> List[Tuple[int, str]]:
    """(lines, path relative to ``root``'s parent) of every module, longest first."""
    sizes = [
        (len(path.read_text().splitlines()), str(path.relative_to(root.parent)))
        for path in root.rglob("*.py")
    ]
    return sorted(sizes, reverse=True)


def _functions(tree: ast.AST, prefix: str) -> Iterator[Tuple[str, ast.AST]]:
    """(qualified name, node) of every function, methods and nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, name + ".")
        else:
            yield from _functions(node, prefix)


def body_lines(function: ast.AST) -> int:
    """The lines of ``function``'s body without its docstring."""
    body = function.body
    docstring = (
        isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )
    if docstring and len(body) > 1:
        body = body[1:]
    return function.end_lineno - body[0].lineno + 1


def function_lines(root: Path = ROOT) -> List[Tuple[int, str]]:
    """(body lines, ``path:qualified.name``) of every function under ``root``, longest first."""
    sizes = []
    for path in root.rglob("*.py"):
        where = str(path.relative_to(root.parent))
        for name, node in _functions(ast.parse(path.read_text()), ""):
            sizes.append((body_lines(node), f"{where}:{name}"))
    return sorted(sizes, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(ROOT))
    parser.add_argument("--lines", type=int, default=700)
    parser.add_argument("--function-lines", type=int, default=80)
    args = parser.parse_args()
    root = Path(args.root).resolve()
    modules = [m for m in module_lines(root) if m[0] > args.lines]
    functions = [f for f in function_lines(root) if f[0] > args.function_lines]
    print(f"{len(modules)} modules over {args.lines} lines:")
    print("\n".join(f"  {n:5d} {name}" for n, name in modules))
    print(f"{len(functions)} functions over {args.function_lines} lines:")
    print("\n".join(f"  {n:5d} {name}" for n, name in functions))


if __name__ == "__main__":
    main()
