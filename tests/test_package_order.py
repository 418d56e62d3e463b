"""Imports point one way: each package imports only packages below it, and no module imports
itself back through others, whether the import is at the top of a file or inside a function
(a function-level import must not hide a cycle) or only for type checking."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("beam_pipelines", "runners", "transforms", "kernels")

# bottom first; packages of one layer are peers and import none of each other
LAYERS = [
    {"transforms.io"},
    {"transforms.resumable"},
    {"transforms.formats"},
    {"kernels"},
    {"transforms.prep", "transforms.decon", "transforms.loader", "transforms.inference"},
    {"transforms.hydra", "transforms.clean", "transforms.dedup"},
    {"runners"},
    {"beam_pipelines"},
]
RANK = {p: i for i, layer in enumerate(LAYERS) for p in layer}


def module_name(path: Path) -> str:
    parts = ["refinery", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(module imported, line) of every refinery import in ``path``, wherever it is."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("refinery.")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if not base.startswith("refinery"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if is_module(sub) else base, node.lineno))
    return out


def package_of(module: str) -> str | None:
    parts = module.split(".")[1:]
    if not parts or parts[0] not in PACKAGES:
        return None
    return ".".join(parts[:2]) if parts[0] == "transforms" and len(parts) > 1 else parts[0]


def graph() -> dict[str, list[tuple[str, int]]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    return {module_name(p): imports_of(p) for p in files}


def test_every_package_is_placed() -> None:
    found = {p for m in graph() if (p := package_of(m)) is not None} - {"transforms"}
    assert found <= set(RANK), f"place these packages in LAYERS: {sorted(found - set(RANK))}"


def test_packages_import_only_packages_below_them() -> None:
    wrong = []
    for module, imports in graph().items():
        mine = package_of(module)
        for target, line in imports:
            theirs = package_of(target)
            if mine in RANK and theirs in RANK and mine != theirs and RANK[theirs] >= RANK[mine]:
                wrong.append(f"{module}:{line} imports {target} ({mine} -> {theirs})")
    assert not wrong, "imports pointing up or sideways:\n" + "\n".join(wrong)


def test_no_import_cycle_between_modules() -> None:
    edges = {m: {t for t, _ in imports if t != m} for m, imports in graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"modules that import each other (directly or through others): {cycles}"


def test_the_checks_see_function_level_and_relative_imports() -> None:
    """The walk finds what the rules are about: an import inside a function, and a relative one."""
    imports = dict(imports_of(ROOT / "transforms" / "resumable" / "orchestration.py"))
    assert "refinery.transforms.resumable.beam_steps" in imports  # imported inside run_stages (Beam loads lazily)
    flink = dict(imports_of(ROOT / "runners" / "flink.py"))
    assert "refinery.runners.flink_local" in flink and "refinery.runners.args" in flink  # `from .x import`
