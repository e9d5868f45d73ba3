"""The package stays a structure a newcomer can walk (issue 40): no import circles, no module longer than a reader can
hold, and `import hf_kvcache` runs none of the Triton kernel modules (imported when a kernel first launches).

Static checks over the source with `ast`: nothing is imported, so they take milliseconds."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hf_kvcache"
MAX_LINES = 600


@cache
def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, from its `__init__.py`)."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute name an `ImportFrom` imports from, inside `module`."""
    if not node.level:
        return node.module or ""
    package = module if _modules()[module].name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, node: ast.AST) -> set[str]:
    """The package's modules an import statement names: `from a import b` names `a.b` if that is a module, else `a`;
    `import a.b` names `a.b`."""
    modules = _modules()
    found = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in modules:
                name = name.rpartition(".")[0]
            found.add(name)
    elif isinstance(node, ast.ImportFrom):
        base = _resolve(module, node)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.add(sub if sub in modules else base)
    return {name for name in found if name in modules and name != module}


def _walk(tree: ast.Module):
    """Every statement (imports are statements) with whether it sits inside a function (runs when called) or runs at
    import."""
    todo = [(node, False) for node in tree.body]
    while todo:
        node, in_function = todo.pop()
        yield node, in_function
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            todo += [(child, inner) for child in getattr(node, field, ())]


@cache
def _tree(module: str) -> ast.Module:
    path = _modules()[module]
    return ast.parse(path.read_text(), filename=str(path))


@cache
def _imports() -> dict[str, list[tuple[str, bool, int]]]:
    """module -> [(imported module of the package, at import time, line)] over module- and function-level imports."""
    graph = {}
    for module in _modules():
        edges = []
        for node, in_function in _walk(_tree(module)):
            for target in _targets(module, node):
                edges.append((target, not in_function, node.lineno))
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan's algorithm, then a
    shortest way back to the component's first module)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        start = min(component)
        paths = {start: [start]}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(graph[v] & component):
                if w == start:
                    cycles.append(paths[v] + [start])
                    queue = []
                    break
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return cycles


def test_the_package_has_no_import_circle():
    """Function-level imports count: one that closes a circle hides it from Python, not from a reader."""
    graph = {module: {target for target, _, _ in edges} for module, edges in _imports().items()}
    cycles = _cycles(graph)
    assert not cycles, "import circles in the package (move what both sides need to where it belongs):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def test_the_checks_see_a_circle():
    """The walk itself: relative imports resolve to modules, and a circle through a function-level import is found."""
    edges = {t for t, _, _ in _imports()["hf_kvcache.kernels"]}
    assert {"hf_kvcache.kernels.backend", "hf_kvcache.kernels.ops"} <= edges
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def _holds_kernels(path: Path) -> bool:
    return path.parent.name == "kernels" and "@triton.jit" in path.read_text()


def test_no_module_is_too_long_to_walk():
    """At most `MAX_LINES` lines a module, except the Triton kernel modules (a kernel and its helpers read together)."""
    long = {}
    for path in _modules().values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and not _holds_kernels(path):
            long[_rel(path)] = lines
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_importing_the_package_never_imports_triton():
    """`import hf_kvcache` (and so `hf_kvcache.kernels`) runs no module of the package that imports Triton: the kernel
    modules are imported by their launchers, inside the function, when a kernel first launches. (PyTorch may import
    Triton by itself: registering the operators of `kernels/library.py` loads dynamo, which looks for it.)"""
    graph = _imports()
    seen, todo = set(), [PACKAGE]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += [target for target, at_import, _ in graph[module] if at_import]
    triton = []
    for module in sorted(seen):
        for node, in_function in _walk(_tree(module)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            if not in_function and any(name.split(".")[0] == "triton" for name in names):
                triton.append(f"{module}:{node.lineno}")
    assert not triton, f"imported with the package, these import Triton at import time: {triton}"


def _imported_with_the_package() -> set[str]:
    """The package's modules that `import hf_kvcache` runs (imports at module level, followed)."""
    graph = _imports()
    seen, todo = set(), [PACKAGE]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += [target for target, at_import, _ in graph[module] if at_import]
    return seen


# Tooling: loaded when used (the command line, evaluation, benchmarks, planning, calibrating), never by the import of a
# user who only runs `generate`
TOOLING = ("hf_kvcache.eval", "hf_kvcache.bench", "hf_kvcache.planner", "hf_kvcache.footprint", "hf_kvcache.cli")


def test_importing_the_package_loads_no_tooling():
    """`import hf_kvcache` runs none of the evaluation, the benchmarks, the planner (and its footprint) or the command
    line: `hf_kvcache.plan` loads the planner at its first use. It used to load all of the evaluation (passkey,
    perplexity) through `plan`."""
    loaded = sorted(m for m in _imported_with_the_package() if m.startswith(TOOLING))
    assert not loaded, f"imported with the package: {loaded}"


# The package's layers, lowest first: a module imports (at import time or inside a function) only from its own layer
# or one below. A prefix names a module and everything under it; the longest prefix that matches places a module.
LAYERS = (
    ("helpers", ("hf_kvcache._compat", "hf_kvcache.configs", "hf_kvcache.models", "hf_kvcache.gpus")),
    ("kernels", ("hf_kvcache.kernels",)),
    ("codecs and storage", ("hf_kvcache.quant", "hf_kvcache.codec", "hf_kvcache.storage", "hf_kvcache.graphs",
                            "hf_kvcache.read", "hf_kvcache.prefill")),
    ("layer and cache", ("hf_kvcache.layer", "hf_kvcache.cache", "hf_kvcache.attention", "hf_kvcache.patching")),
    ("artifact", ("hf_kvcache.artifact",)),
    ("methods", ("hf_kvcache.methods",)),
    ("presets", ("hf_kvcache.presets", "hf_kvcache.warmup", "hf_kvcache.paged", "hf_kvcache.paged_places",
                 "hf_kvcache")),
    ("calibrating and byte counts", ("hf_kvcache.calibration", "hf_kvcache.footprint")),
    ("evaluation", ("hf_kvcache.eval",)),
    ("bench", ("hf_kvcache.bench",)),
    ("planner", ("hf_kvcache.planner",)),
    ("server", ("hf_kvcache.serve",)),
    ("command line", ("hf_kvcache.cli",)),
)
# The one import that runs up on purpose: the package lends `hf_kvcache.plan` from the planner, loaded at first use
UPWARD_ON_PURPOSE = {("hf_kvcache", "hf_kvcache.planner")}


def _layer(module: str) -> int:
    """The index in `LAYERS` of a module; a `__main__` module (`python -m ...`, the way in) stands above them all."""
    if module.rpartition(".")[2] == "__main__":
        return len(LAYERS)
    best = max(((len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} stands in no layer: add it to LAYERS"
    return best[1]


def _upward(graph: dict[str, list[tuple[str, bool, int]]]) -> list[str]:
    return [f"{module}:{line} ({LAYERS[_layer(module)][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
            for module, edges in sorted(graph.items()) for target, _, line in edges
            if _layer(target) > _layer(module) and (module, target) not in UPWARD_ON_PURPOSE]


def test_imports_point_down_the_layers():
    """The library (kernels, then codecs and storage, then the layer and cache, then the methods, then the presets)
    stands below the tooling (calibrating, evaluation, bench, planner, command line), and the calibration artifact
    below the methods that read it. Function-level imports count too: a lazy import up is still an import up."""
    upward = _upward(_imports())
    assert not upward, "imports that run up the layers (move what both need below them):\n" + "\n".join(upward)


def test_the_layer_check_sees_an_import_up():
    assert _layer("hf_kvcache.kernels.decode") < _layer("hf_kvcache.methods.kivi") < _layer("hf_kvcache.cli")
    assert _layer("hf_kvcache") == _layer("hf_kvcache.presets")
    assert _layer("hf_kvcache.calibration.__main__") == len(LAYERS)
    found = _upward({"hf_kvcache.methods.fp8": [("hf_kvcache.calibration.calibrate", False, 7)]})
    assert found == ["hf_kvcache.methods.fp8:7 (methods) imports hf_kvcache.calibration.calibrate "
                     "(calibrating and byte counts)"]


# The format classes of `kernels/layout.py`, and where a test of a value's class against them may stand: the layout
# itself, the registry of their readers, and the methods whose codecs build them
FORMATS = {"PackedFormat", "NUQFormat", "CodebookFormat"}
FORMAT_HOMES = {"hf_kvcache.kernels.layout", "hf_kvcache.kernels.formats", "hf_kvcache.methods.kvquant",
                "hf_kvcache.methods.turboquant"}


def _format_class_tests(tree: ast.AST) -> list[int]:
    """Lines of `isinstance(x, F)` (or a tuple holding F) with F a format class."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(isinstance(k, (ast.Name, ast.Attribute)) and (getattr(k, "id", None) or k.attr) in FORMATS
                   for k in kinds):
                found.append(node.lineno)
    return found


def test_a_format_is_read_through_its_reader_not_tested_by_class():
    """The dispatchers ask a layer's format for its reader (`kernels.formats.READERS`: whether its kernel can read the
    layer, its launcher, its operator, its prefill read); no module outside the formats' own tests a format's class,
    which is what made each new format four `isinstance` chains (`dispatch.py` three times, `prefill.py`)."""
    found = {f"{module}:{line}" for module in _modules() if module not in FORMAT_HOMES
             for line in _format_class_tests(_tree(module))}
    assert not found, f"a format class tested outside its homes: {sorted(found)}"
    assert _format_class_tests(ast.parse("isinstance(f, (int, CodebookFormat))\nisinstance(f, lay.NUQFormat)")) == [1, 2]


KERNEL_MODULES = ("decode", "turbo", "nuq", "workspace", "pack", "tiles")


def test_kernel_modules_share_device_functions_by_public_names():
    """The Triton device functions that several kernels use live in `kernels/tiles.py` under public names; a kernel
    module imports no underscore name of another (turbo, nuq and workspace took up to ten of decode's private ones)."""
    private = []
    for name in KERNEL_MODULES:
        module = f"{PACKAGE}.kernels.{name}"
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.ImportFrom) and node.level and (node.module or "") in KERNEL_MODULES:
                private += [f"{module}:{node.lineno} {alias.name}" for alias in node.names
                            if alias.name.startswith("_")]
    assert not private, f"private names imported between kernel modules: {private}"


def test_every_package_is_installed():
    """`pyproject.toml` lists the packages setuptools installs: a new subpackage missing there works from a checkout
    (and an editable install) but not from a wheel."""
    listed = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), flags=re.M | re.S)
    assert listed, "pyproject.toml lists no packages under [tool.setuptools]"
    names = set(re.findall(r'"([\w.]+)"', listed.group(1)))
    packages = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert packages <= names, f"packages missing from pyproject.toml's [tool.setuptools] packages: {packages - names}"


def _reaches_into_a_layer(tree: ast.AST) -> list[int]:
    """Lines that read or write an underscore attribute of a name `layer` (or `self.layer`, `key.layer`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "layer") or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "layer"):
                found.append(node.lineno)
    return found


def test_a_layers_parts_are_objects_over_its_public_surface():
    """A layer's reads and its CUDA-graphed step are objects it keeps (`layer.reads`, `layer.graph`), not base classes
    sharing its private state; they, the attention and the prefill see the layer through public names only (the
    attention used to set `layer._chunk_kernel_failed`)."""
    layer_class = next(node for node in ast.walk(_tree("hf_kvcache.layer"))
                       if isinstance(node, ast.ClassDef) and node.name == "QuantizedKVLayer")
    assert [ast.unparse(base) for base in layer_class.bases] == ["CacheLayerMixin"]
    found = [f"{module}:{line}" for module in _modules() if module != "hf_kvcache.layer"
             for line in _reaches_into_a_layer(_tree(module))]
    assert not found, f"private state of a layer reached from outside it: {found}"
    assert _reaches_into_a_layer(ast.parse("layer._x = 1\nself.layer._y\nlayer.y\nkey.layer._z()")) == [1, 2, 4]
