"""The package's layers point down, and no module imports itself back through others.

Every import counts, also those inside functions (a lazy import is still a dependency). The
layers, bottom to top, are those of the architecture page (``docs/architecture.md``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import resilient_rl

PACKAGE = Path(resilient_rl.__file__).parent
#: Bottom to top: a module may import its own layer and those below it, never one above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "env", "process_state", "jsonl", "nvml", "lazy", "log_route", "page_lock"),
    ("config",),
    ("protocol", "events"),
    ("data", "algos"),
    ("runtime",),
    ("models",),
    ("checkpoint",),
    ("workers",),
    ("run",),
    ("telemetry",),
    ("recovery",),
    ("trainer",),
    ("faults", "testing"),
    ("plot", "run_status", "cli", "__init__"),
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("resilient_rl",) + path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules ``path`` imports anywhere in it: ``from pkg import mod`` names ``pkg.mod``, ``from mod import x`` ``mod``,
    and the submodules of a lazy export table."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("resilient_rl"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("resilient_rl"))
        elif isinstance(node, ast.Dict):  # a package's lazy exports (resilient_rl.lazy): module name -> names
            found.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
                         and k.value.startswith("resilient_rl."))
    return {m for m in found if m in modules}


def layer_of(module: str) -> int:
    unit = module.split(".")[1] if module.count(".") else "__init__"
    for index, names in enumerate(LAYERS):
        if unit in names:
            return index
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS and to docs/architecture.md")


def upward_imports(modules: dict[str, Path]) -> list[str]:
    return [f"{name} -> {dep}" for name, path in sorted(modules.items())
            for dep in sorted(_imports(path, modules)) if layer_of(dep) > layer_of(name)]


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), over every import."""
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


def test_every_import_points_down_the_layers():
    assert upward_imports(_modules()) == []


def test_no_import_cycle_between_modules():
    assert import_cycles(_modules()) == []


def test_the_checks_see_a_lazy_upward_import_and_a_cycle(tmp_path):
    modules = {"resilient_rl.run.a": tmp_path / "a.py", "resilient_rl.run.b": tmp_path / "b.py",
               "resilient_rl.trainer.ppo": tmp_path / "ppo.py"}
    modules["resilient_rl.run.a"].write_text("def f():\n    from resilient_rl.trainer.ppo import PPOTrainer\n"
                                             "from resilient_rl.run import b\n")
    modules["resilient_rl.run.b"].write_text("import resilient_rl.run.a\n")
    modules["resilient_rl.trainer.ppo"].write_text("")
    assert upward_imports(modules) == ["resilient_rl.run.a -> resilient_rl.trainer.ppo"]
    assert import_cycles(modules) == [["resilient_rl.run.a", "resilient_rl.run.b"]]


def test_no_two_test_modules_share_a_basename():
    """``pytest tests chaos`` imports test modules by basename (no packages): two files of one name in
    tests/ and chaos/ stop the whole collection."""
    root = Path(__file__).resolve().parents[1]
    names = [p.name for d in ("tests", "chaos") for p in (root / d).glob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
