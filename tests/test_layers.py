"""The package's layers (ARCHITECTURE.md): a module imports only from its
own layer or the layers below it, wherever in the module the import is."""

import ast
from pathlib import Path

from conftest import ROOT

# Lowest first; errors.py and blas.py at the root are below every layer.
LAYERS = ["drafting", "engine", "loading", "serving", "training"]
PACKAGE = Path(ROOT) / "redrafter_mlx"


def layer_of(module: str) -> int:
    """-1 for the root modules, else the layer's index; module is dotted, below redrafter_mlx."""
    head = module.split(".")[0]
    return LAYERS.index(head) if head in LAYERS else -1


def imported_modules(path: Path) -> set:
    """Modules of the package that a file imports, dotted below redrafter_mlx."""
    here = path.relative_to(PACKAGE).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - node.level + 1])
                parts = base + (node.module.split(".") if node.module else [])
                names = (
                    [".".join(parts + [alias.name]) for alias in node.names] if not node.module else [".".join(parts)]
                )
            elif node.module and node.module.startswith("redrafter_mlx."):
                names = [node.module[len("redrafter_mlx.") :]]
            else:
                continue
            found.update(n for n in names if n)
        elif isinstance(node, ast.Import):
            found.update(a.name[len("redrafter_mlx.") :] for a in node.names if a.name.startswith("redrafter_mlx."))
    return found


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if module == "__init__":
            continue  # the package's public API gathers from every layer
        for target in imported_modules(path):
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} -> {target}")
    assert not upward


def test_the_layers_are_the_package_folders():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == sorted(LAYERS)


def test_no_import_circles():
    modules = {".".join(p.relative_to(PACKAGE).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}
    modules = {
        m[: -len(".__init__")] if m.endswith(".__init__") else m: p for m, p in modules.items() if m != "__init__"
    }
    graph = {m: {t for t in imported_modules(p) if t in modules and t != m} for m, p in modules.items()}
    state, circles = {}, []

    def visit(module, path):
        state[module] = "open"
        for target in graph[module]:
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not circles


def test_every_script_loads_openblas_before_mlx():
    """``import redrafter_mlx`` loads OpenBLAS into MLX's CPU build, which
    only takes effect before ``mlx.core`` is first imported: a benchmark or
    script that imports mlx first measures MLX's reference BLAS, about 30x
    slower. (Import sorting must not move it: ``# isort: split`` keeps it.)"""
    late = []
    for path in sorted((Path(ROOT) / "bench").rglob("*.py")) + sorted((Path(ROOT) / "scripts").rglob("*.py")):
        order = []
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            order += [n.split(".")[0] for n in names if n.split(".")[0] in ("mlx", "mlx_lm", "redrafter_mlx")]
        if "mlx" in order or "mlx_lm" in order:
            first_mlx = min(order.index(n) for n in ("mlx", "mlx_lm") if n in order)
            if "redrafter_mlx" not in order[:first_mlx]:
                late.append(str(path.relative_to(ROOT)))
    assert not late
