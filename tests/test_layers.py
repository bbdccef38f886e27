"""The package's layers point down: foundations never import orchestration, and no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import resilient_rl

PACKAGE = Path(resilient_rl.__file__).parent
#: Packages and modules below the trainer: they may be imported by it, never import it.
LOWER = ("config", "data", "workers", "checkpoint", "controller", "telemetry", "models", "algos",
         "protocol", "protocol_utils", "errors", "env", "events", "jsonl")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("resilient_rl",) + path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """Modules ``path`` imports: ``from pkg import mod`` names ``pkg.mod``, ``from mod import x`` ``mod``."""
    modules = _modules()
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("resilient_rl"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("resilient_rl"))
    return found


def test_no_lower_layer_imports_the_trainer():
    upward = []
    for name, path in _modules().items():
        if name.count(".") and name.split(".")[1] in LOWER:
            upward += [f"{name} -> {dep}" for dep in sorted(_imports(path, top_level_only=False))
                       if dep.startswith("resilient_rl.trainer")]
    assert upward == []


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {name: {d for d in _imports(path, top_level_only=True) if d in modules and d != name}
             for name, path in modules.items()}
    visiting, done, cycles = set(), set(), []

    def visit(node: str, trail: list[str]) -> None:
        if node in done:
            return
        if node in visiting:
            cycles.append(trail[trail.index(node):] + [node])
            return
        visiting.add(node)
        for dep in sorted(graph[node]):
            visit(dep, trail + [node])
        visiting.discard(node)
        done.add(node)

    for name in sorted(graph):
        visit(name, [])
    assert cycles == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from resilient_rl.trainer.ppo import PPOTrainer\n")
    assert "resilient_rl.trainer.ppo" in _imports(bad, top_level_only=False)
    assert "resilient_rl.trainer.ppo" not in _imports(bad, top_level_only=True)
