"""The house's figures (issue "the house, round 3"): what a reader of the code pays, measured.

    python bench/house.py            # the counts (a second)
    python bench/house.py --mypy     # and mypy (strict, mypy.ini) over the whole checkout (minutes)

Prints one line per figure:
- ``stage_hooks``: the methods and attributes a :class:`Stage` subclass may override (not ``@final``);
- ``long_functions``: functions over 80 lines, outside the HTML report (listed);
- ``long_modules``: modules of the package (not tests/, bench/) over 600 lines, outside the
  HTML report (listed, with their lines);
- ``function_imports``: imports of the project's own modules inside a function (by package);
- ``type_ignores``: ``# type: ignore`` comments;
- ``near_names``: module or class names that differ by one letter (or only by a final ``s``);
- ``mypy_strict_errors`` (with --mypy): errors of mypy over ``-p refinery`` (mypy.ini: strict everywhere).

``tests/test_house_figures.py`` holds each figure at or under its ceiling.
"""
from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("beam_pipelines", "runners", "transforms", "kernels", "bench", "tests", "examples")
LONG_LINES = 80
LONG_MODULE_LINES = 600
LONG_EXEMPT = ("transforms/decon/report_html.py",)


def python_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if ".cache" not in p.parts)


def stage_hooks() -> list[str]:
    """What a Stage subclass may define: the public and hook names of the base class."""
    from refinery.transforms.resumable.base import Stage  # noqa: PLC0415 - the measured object

    state = {"plan_ref", "_units", "_unpickled"}  # the framework's own state on a stage, never overridden
    return sorted(n for n, v in vars(Stage).items() if not n.startswith("__") and n not in state
                  and not getattr(v, "__final__", False))  # @final: the framework's methods


def long_functions() -> list[str]:
    out = []
    for path in python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in LONG_EXEMPT or rel.startswith(("tests/", "bench/")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > LONG_LINES:
                    out.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return out


def long_modules() -> list[str]:
    out = []
    for path in python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in LONG_EXEMPT or rel.startswith(("tests/", "bench/", "examples/")):
            continue
        lines = len(path.read_text().splitlines())
        if lines > LONG_MODULE_LINES:
            out.append(f"{rel} ({lines} lines)")
    return out


def function_imports() -> list[str]:
    """``path:line module`` of every import of a refinery module inside a function."""
    out = []
    for path in python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("tests/", "bench/")):
            continue
        tree = ast.parse(path.read_text(), rel)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("refinery")):
                    out.append(f"{rel}:{node.lineno} {node.module}")
                elif isinstance(node, ast.Import):
                    out += [f"{rel}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("refinery")]
    return sorted(set(out))


def type_ignores() -> list[str]:
    out = []
    for path in python_files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"#\s*type:\s*ignore", line) and path.name != "house.py":
                out.append(f"{path.relative_to(ROOT).as_posix()}:{i}")
    return out


def _near(a: str, b: str) -> bool:
    """One letter apart: a substitution, an insertion or a deletion."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long_ = sorted((a, b), key=len)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def near_names() -> list[str]:
    modules: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    for path in python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("tests/", "bench/", "examples/")):
            continue
        modules.setdefault(path.stem, []).append(rel)
        for node in ast.parse(path.read_text(), rel).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(rel)
    out = [f"class {n}: {', '.join(ps)}" for n, ps in sorted(classes.items()) if len(ps) > 1]
    for kind, names in (("module", modules), ("class", classes)):
        keys = sorted(n for n in names if n != "__init__")
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                if _near(a, b):
                    out.append(f"{kind} {a} ~ {b}: {', '.join(names[a] + names[b])}")
    return out


def mypy_strict_errors() -> int:
    """Errors of mypy over the whole checkout with the project's config (mypy.ini: strict on
    every module of the project), as ``make lint`` runs it."""
    done = subprocess.run([sys.executable, "-m", "mypy", "-p", "refinery"], cwd=ROOT, capture_output=True, text=True)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
    found = re.search(r"Found (\d+) errors?", last)
    if found:
        return int(found.group(1))
    if "Success" in last:
        return 0
    raise SystemExit(f"mypy did not report a count: {last}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mypy", action="store_true", help="also run mypy (strict) over the checkout (minutes)")
    parser.add_argument("--list", action="store_true", help="list what each count counts")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / ".typecheck"))
    figures = {
        "stage_hooks": stage_hooks(),
        "long_functions": long_functions(),
        "long_modules": long_modules(),
        "function_imports": function_imports(),
        "type_ignores": type_ignores(),
        "near_names": near_names(),
    }
    for name, items in figures.items():
        print(f"{name}: {len(items)}")
        if name == "function_imports":
            by_package = Counter(i.split(":")[0].rsplit("/", 1)[0] for i in items)
            print("  by folder: " + ", ".join(f"{k} {v}" for k, v in by_package.most_common()))
        if args.list or name in ("stage_hooks", "near_names", "long_modules"):
            for item in items:
                print(f"  {item}")
    if args.mypy:
        print(f"mypy_strict_errors: {mypy_strict_errors()}")


if __name__ == "__main__":
    main()
