"""The package's layers: every import in megapar/ (those inside functions too) goes down the floors below,
and no import circle spans more than one package.

A package may import only packages on lower floors. So the core (topology, tensor_parallel, model, pipeline)
never imports run, optimizer, checkpoint or planner; config never imports an entry point or a tool; the
optimizer never imports checkpoint or planner; checkpoint never imports planner or run. A new import that
goes up means the imported thing sits too high: move it down rather than the floor.
"""
import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megapar"

# Lowest first. A package is a folder of megapar/ or one of its top-level modules.
FLOORS = (
    {"errors", "atomic", "fp8"},
    {"topology", "data"},
    {"pinned", "kernels", "config"},
    {"tensor_parallel"},
    {"model", "pipeline"},
    {"optimizer"},
    {"checkpoint"},
    {"run", "reshard"},
    {"planner", "inference", "pretrain_gpt2"},   # the planner times steps with run/'s throughput arithmetic
    {"launch"},
    {"cli"},
)
FLOOR = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}


def modules() -> dict[str, Path]:
    """{"megapar.model.gpt2": path} for every module, packages under their own name."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the megapar modules it imports}, from every import statement in it, wherever it stands."""
    def known(name: str) -> str:   # `from m import f` names m.f: the deepest module the name is
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph, missing = defaultdict(set), []
    for mod, path in mods.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                names = [base] + [f"{base}.{a.name}" for a in node.names]
                missing += [f"{mod}: {base}"] if base.startswith("megapar") and base not in mods else []
            else:
                continue
            graph[mod] |= {known(n) for n in names if n.split(".")[0] == "megapar"} - {mod}
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)
    return graph


def package(mod: str) -> str:
    return mod.split(".")[1] if "." in mod else mod


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, stack, on, found = {}, {}, [], set(), []
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    part = []
                    while not part or part[-1] != v:
                        part.append(stack.pop())
                        on.discard(part[-1])
                    if len(part) > 1:
                        found.append(sorted(part))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on.add(w)
                work.append((w, iter(graph[w])))
            elif w in on:
                low[v] = min(low[v], index[w])
    return found


def test_every_package_is_on_a_floor():
    mods = modules()
    assert {package(m) for m in mods if m != "megapar"} == set(FLOOR)


def test_no_import_goes_up_or_sideways():
    graph = imports(modules())
    wrong = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                   if a != "megapar" and b != "megapar" and package(a) != package(b)
                   and FLOOR[package(b)] >= FLOOR[package(a)])
    assert not wrong, "imports that go up the floors (move the imported thing down):\n" + "\n".join(wrong)


def test_no_import_circle_spans_two_packages():
    spanning = [c for c in circles(imports(modules())) if len({package(m) for m in c}) > 1]
    assert not spanning, "import circles across packages:\n" + "\n".join(" ".join(c) for c in spanning)


def test_the_walk_sees_lazy_imports_and_finds_circles():
    """The checks above cannot pass vacuously: an import inside a function counts, and a circle is found."""
    graph = imports(modules())
    assert "megapar.model.sizes" in graph["megapar.optimizer.nvme"]          # imported inside a function
    assert "megapar.pretrain_gpt2" in graph["megapar.launch"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_config_has_no_import_circle():
    """config/ is layered inside too: megatron < settings < checks, recipes, deepspeed < overlays < build."""
    graph = imports(modules())
    inside = {a: {b for b in targets if package(b) == "config"} for a, targets in graph.items()
              if package(a) == "config"}
    assert len(inside) > 5 and not circles(inside), circles(inside)
