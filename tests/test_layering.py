"""The import graph keeps its layers: benchmarks -> serve_app -> engine, nothing upward and no
production module importing the tests' stand-ins (tests/, e.g. tests/serve/fake_engine.py); inside
the engine every import (lazy and annotation-only ones too) points to its own layer or below, and
no modules import each other in a cycle. docs/DESIGN.md draws the same map."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# lowest first; a module belongs to the first entry naming it or a package above it
ENGINE_LAYERS = [
    ("foundations", ["engine.errors", "engine.config", "engine.outputs", "engine.sampling_params",
                     "engine.metrics", "engine.cache_dir", "engine.lazy_heap", "engine.gc_settings",
                     "engine.cpu_kernels", "engine.cpu_load"]),
    ("requests", ["engine.request", "engine.tokenization", "engine.tools", "engine.tool_formats", "engine.reasoning",
                  "engine.harmony", "engine.chat_output", "engine.beam_search", "engine.drafts"]),
    ("model", ["engine.batch", "engine.kv_cache", "engine.models", "engine.attention", "engine.sampler",
               "engine.grammar", "engine.lora"]),
    ("loading", ["engine.model_loader", "engine.quality", "engine.quantization_check",
                 "engine.model_setup"]),
    ("step", ["engine.scheduler", "engine.runner"]),
    ("engine", ["engine.llm_engine", "engine.output_processor", "engine.beam_groups"]),
    ("serving", ["engine.llm", "engine.client", "engine.engine_core", "engine.async_engine", "engine.cli"]),
]
# the test suite's own modules, importable by their bare names where pytest puts their folders on the path
TEST_MODULES = ("tests", *sorted({p.stem for p in (ROOT / "tests").rglob("*.py")} - {"__init__"}))
# what each top-level package must never import: nothing above it, and no test stand-in
FORBIDDEN = {"engine": ("serve_app", "benchmarks", "cluster", "ray", *TEST_MODULES),
             "serve_app": ("benchmarks", "cluster", *TEST_MODULES), "cluster": TEST_MODULES}


def _modules(package: str) -> dict[str, Path]:
    modules = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path) -> set[str]:
    """Every module `path` names in an import statement, anywhere in it (a `from x import y`
    counts as x.y where that is a module, else x), but under `if TYPE_CHECKING:`: a name the
    type checker alone reads is no dependency at run time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _nodes(tree: ast.AST):
    """ast.walk, leaving out the bodies of `if TYPE_CHECKING:` blocks."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _engine_graph() -> dict[str, set[str]]:
    modules = _modules("engine")
    return {name: {m for m in _imports(name, path) if m in modules and m != name} for name, path in modules.items()}


def _layer(module: str) -> int:
    if module == "engine":  # the package's facade, which exports the serving layer lazily
        return len(ENGINE_LAYERS) - 1
    for index, (_, prefixes) in enumerate(ENGINE_LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer of ENGINE_LAYERS: place it")


def test_no_package_imports_one_above_it():
    for package, forbidden in FORBIDDEN.items():
        for name, path in _modules(package).items():
            bad = sorted(m for m in _imports(name, path) if m.split(".")[0] in forbidden)
            assert not bad, f"{name} imports {bad}"


def test_every_engine_import_points_to_its_own_layer_or_below():
    upward = [f"{module} ({ENGINE_LAYERS[_layer(module)][0]}) -> {dep} ({ENGINE_LAYERS[_layer(dep)][0]})"
              for module, deps in _engine_graph().items() for dep in deps if _layer(dep) > _layer(module)]
    assert not upward, "imports pointing up a layer:\n" + "\n".join(sorted(upward))


def test_no_engine_modules_import_each_other_in_a_cycle():
    graph = _engine_graph()
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_checks_see_what_they_check():
    """The graph is read from the real tree: it holds the edges the engine is built on, and an
    upward import would be caught."""
    graph = _engine_graph()
    assert "engine.scheduler.scheduler" in graph["engine.llm_engine"]
    assert "engine.batch" in graph["engine.attention.base"]  # an annotation-only or runtime import alike
    assert _layer("engine.runner.model_runner") > _layer("engine.attention.base")
    assert "ray" in {m.split(".")[0] for m in _imports("serve_app.draft", ROOT / "serve_app" / "draft.py")}
    assert {"fake_engine", "handles", "conftest"} <= set(FORBIDDEN["serve_app"])
