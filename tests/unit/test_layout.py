"""The code's rooms: each package under src/worker imports only from the ones below it, vLLM is
imported by the adapter's package alone, and the layout table of docs/development.md is the packages' own
docstrings."""

import ast
import json
import re
import subprocess
import sys

from conftest import REPO
from doc_pages import DOCS, section

SRC = REPO / "src"
# Bottom to top: a room may import from the rooms before it (and itself), never after.
ROOMS = ["env_text", "wire", "vllm_adapter", "model", "config", "jobs", "engine", "routes", "load_balancer", "scheduling", "startup"]


def _modules() -> dict[str, ast.Module]:
    return {".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"):
            ast.parse(path.read_text()) for path in SRC.rglob("*.py")}


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module) -> set[str]:
    """Modules ``tree`` imports when it runs (in functions too), not those it names for type checks."""
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt | ast.excepthandler))
    return found


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "worker" and len(parts) > 1 else None


def test_each_room_imports_only_from_the_rooms_below_it():
    wrong = []
    for name, tree in _modules().items():
        if (room := _room(name)) is None:
            continue
        for imported in _imports(tree):
            other = _room(imported)
            if other in ROOMS and ROOMS.index(other) > ROOMS.index(room):
                wrong.append(f"{name} imports {imported}")
    assert not wrong
    assert {_room(name) for name in _modules()} - {None} == set(ROOMS)


def test_no_module_outside_the_adapter_imports_vllm_or_torch():
    """Statically, anywhere in a module, and at run time through any import path (``importlib``
    included): every module is imported with both import functions watched. The adapter's package
    itself (its ``__init__``) imports nothing, so that each caller pulls in only the modules it names."""
    static = sorted(name for name, tree in _modules().items() if _room(name) != "vllm_adapter"
                    and any(imported.split(".")[0] in ("vllm", "torch") for imported in _imports(tree)))
    assert static == []
    assert not _imports(_modules()["worker.vllm_adapter"])
    code = """
import builtins, importlib, json, sys
seen, ours = set(), tuple(json.loads(sys.argv[1]))
def note(importer, name):
    if name.split(".")[0] in ("vllm", "torch") and importer.split(".")[0] in ours:
        seen.add(importer)
real_import, real_import_module = builtins.__import__, importlib.import_module
def watched_import(name, globals=None, *args, **kwargs):
    note((globals or {}).get("__name__", ""), name)
    return real_import(name, globals, *args, **kwargs)
def watched_import_module(name, package=None):
    note(sys._getframe(1).f_globals.get("__name__", ""), name)
    return real_import_module(name, package)
builtins.__import__, importlib.import_module = watched_import, watched_import_module
for module in json.loads(sys.argv[2]):
    real_import_module(module)
print(json.dumps(sorted(seen)))
"""
    modules = sorted(name for name in _modules() if name != "handler")
    tops = sorted({name.split(".")[0] for name in modules})
    result = subprocess.run([sys.executable, "-c", code, json.dumps(tops), json.dumps(modules)], cwd=SRC,
                            capture_output=True, text=True, check=True)
    importers = json.loads(result.stdout)
    assert importers and {_room(name) for name in importers} == {"vllm_adapter"}, result.stderr


def test_the_rooms_below_the_adapters_users_import_without_vllm():
    """What the local endpoint, the bake step and the start-up's first steps use stays plain."""
    plain = [name for name in _modules() if _room(name) in ("env_text", "wire", "model", "jobs")]
    plain += ["worker.config.settings", "worker.config.early_settings", "worker.config.model_request",
              "worker.config.worker_config", "worker.startup.failed_start", "worker.startup.process_exit"]
    code = (f"import importlib, sys; [importlib.import_module(m) for m in {plain!r}]; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=SRC, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stderr


def test_the_documented_layout_is_the_folder_and_each_packages_docstring():
    layout = section(DOCS / "development.md", "Code layout")
    rows = dict(re.findall(r"^\| `src/worker/(\w+)/` \| (.+) \|$", layout, re.MULTILINE))
    packages = {path.parent.name: path.parent for path in (SRC / "worker").glob("*/__init__.py")}
    assert rows.keys() == packages.keys()
    for name, folder in packages.items():
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        modules = ", ".join(sorted(path.stem for path in folder.glob("*.py") if path.stem != "__init__"))
        assert rows[name] == f"{' '.join(doc.split()).removesuffix('.')}: {modules}"
    top = set(re.findall(r"`src/(\w+\.py)`", layout))
    assert top == {path.name for path in SRC.glob("*.py")}
