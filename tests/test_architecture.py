"""The package layout's rules, checked on the source (docs/design.md §1):

- no import cycles between the project's modules (any import statement, at any depth:
  a function-level import still ties two modules together);
- arrows run one way: core (pure Python) <- runner <- engine <- server, kernels below
  models, and nothing below the engine knows the engine or the server;
- `jaxserve/core` never imports jax or flax;
- the names the tests import are the project's packages, not test folders that share
  their names (tests/models, tests/server, tests/pallas_kernels).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "models", "pallas_kernels", "server")

# (importing layer, imported layer) pairs that must not exist. A layer is a module
# prefix; the longest prefix that matches names a module's layer.
FORBIDDEN = {
    "jaxserve.core": ("jaxserve.runner", "jaxserve.engine", "jaxserve.distributed", "server", "models",
                      "pallas_kernels", "jaxserve.sample", "jaxserve.spec_decode"),
    "jaxserve.distributed": ("jaxserve.runner", "jaxserve.engine", "server"),
    "jaxserve.runner": ("jaxserve.engine", "server"),
    "jaxserve.sample": ("jaxserve.runner", "jaxserve.engine", "server"),
    "pallas_kernels": ("models", "jaxserve.runner", "jaxserve.engine", "server"),
    "models": ("jaxserve.runner", "jaxserve.engine", "server"),
    "jaxserve.engine": ("server",),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


def _imports(name: str, path: Path) -> set[str]:
    """Every module name an import statement of `path` names (absolute, resolved)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(target: str) -> str | None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target or None

    graph = {}
    for name, path in mods.items():
        targets = {owner(t) for t in _imports(name, path)}
        # a module importing its own package (`from jaxserve import x` inside jaxserve.llm) is no edge
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _layer(module: str) -> str:
    matches = [p for p in {*FORBIDDEN, *(t for ts in FORBIDDEN.values() for t in ts)}
               if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else module


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_arrows_run_one_way():
    upward = sorted(f"{m} -> {t}" for m, targets in _graph().items() for t in targets
                    if _layer(t) in FORBIDDEN.get(_layer(m), ()))
    assert upward == []


def test_core_is_pure_python():
    third_party = ("jax", "jaxlib", "flax")
    offenders = sorted(f"{name}: {imp}" for name, path in _modules().items() if name.startswith("jaxserve.core")
                       for imp in _imports(name, path) if imp.split(".")[0] in third_party)
    assert offenders == []


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_resolve_to_the_project(package):
    mod = importlib.import_module(package)
    assert getattr(mod, "__file__", None) is not None, f"{package} resolved to {list(mod.__path__)}"
    assert Path(mod.__file__).resolve().parent == ROOT / package
