"""The import graph of the code runs one way (README.md, under "The tree"): the top-level packages
in the order of LAYERS (and pretrain/model reads no data), no circle among the modules of
grt_common/, pretrain/, data_pipeline/ and launcher/, counting every import (a function's own and
those under TYPE_CHECKING too: a circle of type-only imports is still two modules that cannot be
read apart), and no module imports another's private (`_x`) names."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("grt_common", "pretrain", "data_pipeline", "launcher")
# The top-level packages, lowest first: each imports only those before it. grt_common is the bottom
# both others share (the errors and their one line, files written whole); pretrain reads its data
# through data_pipeline, never the reverse; the launcher starts pretrain's runs and reads manifests.
LAYERS = ("grt_common", "data_pipeline", "pretrain", "launcher")
# Plain PyTorch reads no data: a layer that has a tokenizer (pretrain/infer's export) hands it over.
NOT_BELOW = {"pretrain.model": "data_pipeline"}


def _modules(root: Path) -> dict[str, Path]:
    """{dotted module name: its file}; a package's __init__.py is the package itself."""
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(the project module imported, the name taken from it or '' for the module, line) of every
    import statement in the file, wherever it stands."""

    def owner(name: str) -> str | None:  # the module a dotted name is, or lies in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(t, "", node.lineno) for a in node.names if (t := owner(a.name))]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:  # `from pretrain.runs import checkpoint_files`: the module itself
                    found.append((sub, "", node.lineno))
                elif t := owner(base):
                    found.append((t, a.name, node.lineno))
    return [(t, name, line) for t, name, line in found if t != module]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(what, line) of each private name of another project module that the file uses:
    `from x import _y`, and `x._y` where x is a module it imported."""
    uses = [(f"{t}.{name}", line) for t, name, line in _imports(module, path, modules) if _private(name)]
    tree = ast.parse(path.read_text(), str(path))
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.asname and a.name in modules and a.name != module}
        elif isinstance(node, ast.ImportFrom) and node.module:
            aliases |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in modules}
    uses += [
        (f"{node.value.id}.{node.attr}", node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
        and _private(node.attr)
    ]
    return uses


def test_the_import_graph_has_no_circles():
    """Training, inference and the launcher read what they share (pretrain/runs/, pretrain/model_config.py)
    from below: a circle names its modules and the imports that close it."""
    modules = _modules(REPO)
    edges = {m: _imports(m, p, modules) for m, p in modules.items()}
    graph = {m: {t for t, _, _ in e} for m, e in edges.items()}
    cycles = _cycles(graph)
    where = [
        f"{modules[m].relative_to(REPO)}:{line} imports {t}{'.' + name if name else ''}"
        for group in cycles
        for m in group
        for t, name, line in edges[m]
        if t in group
    ]
    assert not cycles, "import circles:\n" + "\n".join(where)
    assert len(modules) > 50 and sum(map(len, graph.values())) > 100  # the scan does read the tree


def _wrong_way(root: Path) -> list[str]:
    """Each import of a higher package (LAYERS) by a lower one, or of a NOT_BELOW package by its
    importer: `file:line imports module`."""
    modules = _modules(root)
    found = []
    for m, p in modules.items():
        below = LAYERS.index(m.split(".")[0])
        for t, _, line in _imports(m, p, modules):
            over = LAYERS.index(t.split(".")[0]) > below
            if over or any(m.startswith(a) and t.startswith(b) for a, b in NOT_BELOW.items()):
                found.append(f"{p.relative_to(root)}:{line} imports {t}")
    return found


def test_the_packages_import_one_way():
    """grt_common imports nothing of the project, data_pipeline nothing of pretrain or the launcher,
    pretrain nothing of the launcher, and pretrain/model nothing of data_pipeline, wherever the import
    stands (a function's own, under TYPE_CHECKING): each import the wrong way is named."""
    found = _wrong_way(REPO)
    assert not found, "imports against " + " -> ".join(reversed(LAYERS)) + ":\n" + "\n".join(found)


def _folder(module: str) -> str:
    """The room a module stands in: a folder of pretrain/ or a module directly under it; data_pipeline, launcher."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pretrain" else parts[0]


def test_the_folders_import_one_way():
    """Taken a folder at a time (pretrain/model, pretrain/infer, pretrain/runs, pretrain/training, ...),
    the graph has no circle either: a file of a lower folder importing a higher one (model/hf.py
    reading infer/load.py was one) makes two folders that cannot be read apart."""
    modules = _modules(REPO)
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for m, p in modules.items():
        for t, _, line in _imports(m, p, modules):
            a, b = _folder(m), _folder(t)
            if a != b:
                graph.setdefault(a, set()).add(b)
                where.setdefault((a, b), f"{p.relative_to(REPO)}:{line} imports {t}")
    cycles = _cycles(graph)
    shown = [where[a, b] for group in cycles for a in group for b in group if (a, b) in where]
    assert not cycles, f"folder circles {cycles}:\n" + "\n".join(shown)


# What the launcher may not import: a start's command line, plan and DeepSpeed config come to it through
# the start's one entry (pretrain/training/start/entry.py), not through `grt train`'s module or the engine.
LAUNCHER_NEVER = ("pretrain.train", "pretrain.training.engine")


def test_the_launcher_reaches_the_start_through_its_entry():
    """No module of launcher/ imports pretrain.train or anything of pretrain/training/engine/ (nor a
    name from them), wherever the import stands."""
    modules = _modules(REPO)
    found = [
        f"{p.relative_to(REPO)}:{line} imports {t}"
        for m, p in modules.items()
        if m.split(".")[0] == "launcher"
        for t, _, line in _imports(m, p, modules)
        if any(t == never or t.startswith(never + ".") for never in LAUNCHER_NEVER)
    ]
    assert not found, "the launcher imports past the start's entry:\n" + "\n".join(found)
    cli = _imports("launcher.cli", modules["launcher.cli"], modules)
    assert any(t == "pretrain.training.start.entry" for t, _, _ in cli)  # the scan does read the launcher


# The rooms of each folder that has sub-packages, lowest first (README.md, "The tree"): a room
# imports only rooms before it. A new module or sub-package takes its place here.
ROOMS = {
    "pretrain.training": (
        "callbacks",  # the fit loop's hook points, for the concerns that run no collective
        "depth",  # how many loop steps a step runs
        "health",  # run health: heartbeat, who failed, stop signals
        "run_context",  # what each component of a run is built from
        "engine",  # DeepSpeed config, engine, internals, optimizer, LR schedule, compile, checkpointing
        "report",  # metrics, step log, timing, profiler, W&B
        "checkpoint",  # checkpoint files: complete or invisible, other world sizes, background saves
        "start",  # the start's plan: resume and branch rules, run directory, lock
        "data",  # the run's data
        "step",  # one optimizer step: controls, bad batches, spikes
        "evaluation",  # validation and tasks during training
        "run_checkpoints",  # the run's loads, saves and rollbacks
        "fault_injection",  # the tests' fault injections, installed in the rooms below
        "trainer",  # the loop
    ),
    "pretrain.infer": (
        "adaptive",
        "kv_cache",
        "load",
        "exit_depths",
        "loop_health",
        "generate",
        "evaluation",
        "analyze",
        "hf_export",
        "export",
    ),
    "pretrain.tools": ("bench", "compare", "loop_start", "demo"),
}
MAX_TOP_MODULES = 10


def test_the_rooms_of_a_folder_import_in_order():
    """Inside pretrain/training, pretrain/infer and pretrain/tools, every module and sub-package is a
    room of ROOMS, at most MAX_TOP_MODULES modules stand at the top, and a room imports only rooms
    listed before it."""
    modules = _modules(REPO)
    for folder, order in ROOMS.items():
        top = REPO.joinpath(*folder.split("."))
        rooms = {p.stem for p in top.glob("*.py") if p.name != "__init__.py"} | {
            p.name for p in top.iterdir() if (p / "__init__.py").is_file()
        }
        assert rooms == set(order), (
            f"{folder}: rooms not in ROOMS: {sorted(rooms - set(order))}; gone: {sorted(set(order) - rooms)}"
        )
        n_top = len([p for p in top.glob("*.py") if p.name != "__init__.py"])
        assert n_top <= MAX_TOP_MODULES, f"{folder}: {n_top} modules at its top (at most {MAX_TOP_MODULES})"
        rank = {room: i for i, room in enumerate(order)}
        upward = []
        for m, p in modules.items():
            if not m.startswith(folder + "."):
                continue
            room = m[len(folder) + 1 :].split(".")[0]
            for t, _, line in _imports(m, p, modules):
                if t.startswith(folder + ".") and (other := t[len(folder) + 1 :].split(".")[0]) != room:
                    if rank[other] > rank[room]:
                        upward.append(f"{p.relative_to(REPO)}:{line} imports {t} ({room} is below {other})")
        assert not upward, f"{folder}: rooms importing upward:\n" + "\n".join(upward)


def test_no_module_imports_another_modules_private_names():
    modules = _modules(REPO)
    found = [
        f"{p.relative_to(REPO)}:{line}: {what}"
        for m, p in modules.items()
        for what, line in _private_uses(m, p, modules)
    ]
    assert not found, "private names used outside their module:\n" + "\n".join(found)


def test_the_checks_see_what_they_refuse(tmp_path):
    """A circle of type-only imports, a function's own import and a private name, in a tree of
    three files: each is found."""
    (tmp_path / "pretrain").mkdir()
    (tmp_path / "pretrain" / "__init__.py").write_text("")
    (tmp_path / "pretrain" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pretrain.b import B\n"
    )
    (tmp_path / "pretrain" / "b.py").write_text(
        "from pretrain import a\n\n\ndef f():\n    from pretrain.a import _hidden\n\n    return a._other\n"
    )
    modules = _modules(tmp_path)
    graph = {m: {t for t, _, _ in _imports(m, p, modules)} for m, p in modules.items()}
    assert _cycles(graph) == [["pretrain.a", "pretrain.b"]]
    assert sorted(what for what, _ in _private_uses("pretrain.b", modules["pretrain.b"], modules)) == [
        "a._other",
        "pretrain.a._hidden",
    ]


def test_the_direction_check_sees_an_import_the_wrong_way(tmp_path):
    """A function's own import of pretrain in data_pipeline, a type-only one of data_pipeline in
    pretrain/model, and one of launcher in grt_common: each is named; pretrain importing data_pipeline is not."""
    files = {
        "grt_common/base.py": "import launcher.top\n",
        "data_pipeline/reader.py": "def f():\n    from pretrain.model.net import Net\n\n    return Net\n",
        "pretrain/model/net.py": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from data_pipeline.reader import f\n",
        "pretrain/infer/load.py": "from data_pipeline.reader import f\n",
        "launcher/top.py": "",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert sorted(_wrong_way(tmp_path)) == [
        "data_pipeline/reader.py:2 imports pretrain.model.net",
        "grt_common/base.py:1 imports launcher.top",
        "pretrain/model/net.py:3 imports data_pipeline.reader",
    ]


def test_the_readme_tree_names_every_module():
    """README.md's tree has a row per folder of pretrain/ that holds code, and each module is named
    in its folder's row (or has a row of its own): the tree is where a new engineer finds a file."""
    rows = {}
    for line in (REPO / "README.md").read_text().split("\n## The tree", 1)[1].split("\n## ", 1)[0].splitlines():
        if line.startswith("| `"):
            path, _, text = line[3:].partition("` |")
            rows[path.rstrip("/")] = text
    missing = []
    for path in sorted((REPO / "pretrain").rglob("*.py")):
        rel = path.relative_to(REPO)
        if path.name == "__init__.py" or "hf_remote" in rel.parts:
            continue
        folder = rel.parent.as_posix()
        if (
            rel.as_posix() not in rows
            and f"`{path.name}`" not in rows.get(folder, "")
            and rel.as_posix() not in "".join(rows.values())
        ):
            missing.append(rel.as_posix())
    assert not missing, "modules README.md's tree does not name: " + ", ".join(missing)
