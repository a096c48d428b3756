"""The folders are the architecture: every import inside ``qerl/`` (module level and deferred, inside functions) points
to the same or a lower layer, and no modules import each other in a circle.

Layers, lowest first (a module belongs to the layer of its longest matching prefix):

    kernels                  the Triton kernels every weight format shares (the ground floor)
    nvfp4 format, kernels    the weight format and the Triton kernels on it
    nvfp4 layer, checkpoint  the frozen Linear and the compressed-tensors checkpoint format (below it only the
                             shared kernels)
    hub                      where models and tokenizers come from
    ranks                    what each process of a multi-process run owns (its seeds, its share of a checkpoint)
    user code                functions and classes the config names (rewards, tools, environments), imported
    tools                    what the model may call in an episode (tools, environments, the Python sandbox)
    data                     prompts, answers, rewards
    model                    the policy (NVFP4 + LoRA), its loading, AQN
    rollout                  the engines that sample from the policy
    agents                   multi-turn episodes over any engine (tool results and observations between turns)
    RL step                  losses, advantages, log-probs, evaluation, the LightningModule
    callbacks                Lightning callbacks around the RL step
    run                      the memory plan and the resolution of the parsed config, before anything is built
    CLI                      the command lines
    fixtures                 test and benchmark models (nothing in the product imports them)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kernels", ("qerl.kernels",)),
    ("nvfp4 format, kernels", ("qerl.nvfp4.format", "qerl.nvfp4.kernels")),
    ("nvfp4 layer, checkpoint", ("qerl.nvfp4",)),
    ("hub", ("qerl.hub",)),
    ("ranks", ("qerl.ranks",)),
    ("user code", ("qerl.user_code",)),
    ("tools", ("qerl.tools",)),
    ("data", ("qerl.data",)),
    ("model", ("qerl.model",)),
    ("rollout", ("qerl.rollout",)),
    ("agents", ("qerl.agents",)),
    ("RL step", ("qerl.modules",)),
    ("callbacks", ("qerl.callbacks",)),
    ("run", ("qerl.run",)),
    ("CLI", ("qerl.cli", "qerl.quantize", "qerl.export", "qerl")),
    ("fixtures", ("qerl.testing",)),
)


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir`` (a package's ``__init__`` is the package)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str], top: str) -> set[str]:
    """The modules of the package that ``path`` imports, anywhere in the file (function bodies included)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            # ``from a.b import c`` imports the module a.b.c when there is one, else names from a.b
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import a.b.c`` where a.b.c is a name: its module
                target = target.rpartition(".")[0]
            if target.split(".")[0] == top and target != name:
                found.add(target)
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    files = module_files(package_dir)
    return {name: imports_of(name, path, set(files), package_dir.name) for name, path in files.items()}


def layer_of(name: str, layers=LAYERS) -> int:
    best, index = "", None
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    if index is None:
        raise AssertionError(f"{name} is in no layer: add it to LAYERS in tests/test_layering.py")
    return index


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    return sorted(f"{a} ({layers[layer_of(a, layers)][0]}) imports {b} ({layers[layer_of(b, layers)][0]})"
                  for a, targets in graph.items() for b in targets if layer_of(b, layers) > layer_of(a, layers))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT / "qerl")


def test_every_module_has_a_layer(graph):
    for name in graph:
        layer_of(name)


def test_no_import_points_up_a_layer(graph):
    assert upward_imports(graph) == []


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_nvfp4_stands_on_the_shared_kernels_alone(graph):
    outside = {b for a, targets in graph.items() if a.startswith("qerl.nvfp4") for b in targets
               if not b.startswith(("qerl.nvfp4", "qerl.kernels"))}
    assert outside == set()
    shared = {b for a, targets in graph.items() if a.startswith("qerl.kernels") for b in targets
              if not b.startswith("qerl.kernels")}
    assert shared == set()
    assert any(b.startswith("qerl.nvfp4.kernels") for b in graph["qerl.nvfp4.linear"])  # deferred imports are read


def test_the_checker_finds_cycles_and_upward_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from pkg.high import b  # deferred\n")
    (pkg / "low" / "c.py").write_text("from . import a\nfrom .a import f\n")
    (pkg / "high.py").write_text("import pkg.low.c\nb = 1\n")
    layers = (("low", ("pkg.low",)), ("high", ("pkg.high", "pkg")))
    g = import_graph(pkg)
    assert g["pkg.low.c"] == {"pkg.low.a"} and g["pkg.low.a"] == {"pkg.high"} and g["pkg.high"] == {"pkg.low.c"}
    assert upward_imports(g, layers) == ["pkg.low.a (low) imports pkg.high (high)"]
    assert cycles(g) == [["pkg.high", "pkg.low.a", "pkg.low.c"]]
