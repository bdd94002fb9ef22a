"""The layering of the package, checked from its source (every import is
parsed, type-only ones under TYPE_CHECKING included):

- paths/, gpu/, providers/, schedule/, topology/, control/ and metadata/
  never import engine/ (a lower layer gets a small object: PathContext,
  ProviderContext, PeerLink, BatchSink, never the Engine or the Peer);
  schedule/ holds policies the providers and the engine use, and imports
  neither;
- paths/ (the ways a batch travels besides one native channel) sits
  between engine/ and providers/: nothing below it imports it, and gpu/
  (GPU helpers with no engine knowledge) imports neither it nor engine/;
- the library never imports cli/, connector/, compat/, examples or tools;
- no provider name is compared as a string outside providers/ (decisions
  ask a provider's caps). Exempt: topology/, whose strings name memory
  locations ("cuda:N") and NIC kinds ("rdma"), and the outer layers' input
  parsing (cli/ flags, compat/'s Mooncake protocol argument), which turn
  what a user wrote into protocols;
- connector/ and compat/ use kvflow's public names: no private attribute
  of the engine's layers is reached from them;
- _cuda/ (the driver's bindings and the kernels) imports nothing of
  kvflow but kvflow.errors and itself: gpu/, paths/, the providers and the
  engine build on it, never the other way (its IBGDA launcher, which once
  imported providers/rdma/ibgda.py, is gpu/ibgda.py);
- store/ (the KVCache pool) is built on kvflow's public API: it imports
  only `kvflow` itself (its exported names), kvflow.errors, kvflow.metadata
  and its own modules, and reaches no private attribute of the engine's
  layers; nothing in the library imports store/ but the outer layers;
- inside engine/: the Peer keeps no reference to the Engine (it gets a
  PeerContext), only engine/router.py decides a batch's path (a
  relay's route(), GPU memory's touches(), a provider's caps.same_host,
  caps.remote or caps.memory, a Route built, a provider compared by
  identity), and only engine/router.py imports paths/ (the engine composes
  through it); a module that only re-exports a moved name for its old
  import path (nothing but imports and __all__) may import it too.

The README's size (12 KB) is held by tests/test_readme.py.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import kvflow

PKG = pathlib.Path(kvflow.__file__).parent
ROOT = PKG.parent
PROVIDER_NAMES = {"local", "tcp", "rdma", "cuda", "relay"}
LOWER = ("paths", "gpu", "providers", "schedule", "topology", "control", "metadata")
BELOW_PATHS = ("gpu", "providers", "schedule", "topology", "control", "metadata", "_cuda")
OUTER = ("cli", "connector", "compat")


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


MODULES = _modules()


def _imports(module: str, tree: ast.Module) -> set[str]:
    """Every module `module` imports, absolute, wherever the import sits."""
    found: set[str] = set()
    package = module if module in MODULES and _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)   # `from kvflow import engine`
    return found


def _is_package(module: str) -> bool:
    return (PKG.parent / module.replace(".", "/") / "__init__.py").exists()


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _inside(name: str, layer: str) -> bool:
    return name == f"kvflow.{layer}" or name.startswith(f"kvflow.{layer}.")


def test_the_parser_sees_the_layers():
    # a walk that found nothing would pass every rule below
    assert {"kvflow.engine.engine", "kvflow.providers.base", "kvflow.control.server"} <= set(MODULES)
    assert "kvflow.providers.base" in _imports("kvflow.providers.tcp", MODULES["kvflow.providers.tcp"])


@pytest.mark.parametrize("layer", LOWER)
def test_lower_layers_never_import_the_engine(layer):
    bad = sorted((m, i) for m, tree in MODULES.items() if _layer(m) == layer
                 for i in _imports(m, tree) if _inside(i, "engine"))
    assert not bad, f"{layer}/ imports engine/: {bad}"


@pytest.mark.parametrize("layer", BELOW_PATHS)
def test_layers_below_paths_never_import_it(layer):
    bad = sorted((m, i) for m, tree in MODULES.items() if _layer(m) == layer
                 for i in _imports(m, tree) if _inside(i, "paths"))
    assert not bad, f"{layer}/ imports paths/ (an arrow running up): {bad}"


def test_cuda_imports_only_errors():
    bad = sorted((m, i) for m, tree in MODULES.items() if _layer(m) == "_cuda"
                 for i in _imports(m, tree)
                 if i.split(".")[0] == "kvflow" and not (_inside(i, "_cuda") or _inside(i, "errors")))
    assert not bad, f"_cuda/ imports more of kvflow than kvflow.errors: {bad}"


def test_schedule_imports_no_provider():
    bad = sorted((m, i) for m, tree in MODULES.items() if _layer(m) == "schedule"
                 for i in _imports(m, tree) if _inside(i, "providers"))
    assert not bad, f"schedule/ imports providers/: {bad}"


def test_the_library_never_imports_outer_layers():
    bad = []
    for m, tree in MODULES.items():
        if _layer(m) in OUTER:
            continue
        for i in _imports(m, tree):
            if any(_inside(i, o) for o in OUTER) or i.split(".")[0] in ("examples", "tools"):
                bad.append((m, i))
    assert not bad, f"the library imports an outer layer: {sorted(bad)}"


def _provider_literals(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & PROVIDER_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_provider_literals(e) for e in node.elts)) if node.elts else set()
    return set()


def test_no_provider_name_compared_outside_providers():
    bad = []
    for m, tree in MODULES.items():
        if _layer(m) in ("providers", "topology", "cli", "compat"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                names = set().union(*(_provider_literals(x) for x in [node.left, *node.comparators]))
                if names:
                    bad.append(f"{m}:{node.lineno} compares with {sorted(names)}")
    assert not bad, "provider names compared as strings (ask Provider.caps):\n" + "\n".join(bad)


def _private_names(layers: tuple[str, ...]) -> set[str]:
    """Private attributes and methods the given layers define."""
    names: set[str] = set()
    for m, tree in MODULES.items():
        if _layer(m) not in layers:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_") \
                    and not node.name.startswith("__"):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
    return names


@pytest.mark.parametrize("outer", ["connector", "compat", "store"])
def test_outer_layers_use_public_names(outer):
    inner = _private_names(("engine", "paths", "gpu", "providers", "control", "schedule"))
    own = _private_names((outer,))
    bad = []
    for m, tree in MODULES.items():
        if _layer(m) != outer:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in inner and node.attr not in own:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    bad.append(f"{m}:{node.lineno} .{node.attr}")
    assert not bad, f"{outer}/ reaches into the engine's privates:\n" + "\n".join(bad)


# config: every KVFLOW_* variable is read through kvflow.config
# (tests/test_config.py), the store's own knobs too; it imports nothing of kvflow's
STORE_MAY_IMPORT = ("errors", "metadata", "store", "config")


def test_store_uses_the_public_api_only():
    public = {f"kvflow.{n}" for n in kvflow.__all__}
    seen = 0
    bad = []
    for m, tree in MODULES.items():
        if _layer(m) != "store":
            continue
        seen += 1
        for i in _imports(m, tree):
            if i.split(".")[0] == "kvflow" and i != "kvflow" and i not in public \
                    and not any(_inside(i, ok) for ok in STORE_MAY_IMPORT):
                bad.append((m, i))
    assert seen >= 5, "the walk found no store/ modules"
    assert not bad, f"store/ imports kvflow internals: {sorted(bad)}"


def test_the_library_never_imports_the_store():
    bad = sorted((m, i) for m, tree in MODULES.items() if _layer(m) not in OUTER + ("store",)
                 for i in _imports(m, tree) if _inside(i, "store"))
    assert not bad, f"the library imports store/: {bad}"


def test_every_package_is_installed():
    """A package missing from pyproject's list is left out of a wheel or a
    plain `pip install .` (the editable install used here hides it)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    with open(ROOT / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvflow").rglob("__init__.py")}
    assert found - listed == set(), "packages not in pyproject.toml [tool.setuptools] packages"
    assert listed - found - {"kvflow._native"} == set(), "pyproject.toml lists packages that do not exist"


# ------------------------------------------------------------ the engine's rooms
# A Peer gets a PeerContext (kvflow.engine.context): what it may use of its
# engine. Its hooks are bound methods of the engine's (as ProviderContext's
# are), but neither the Peer nor its context holds, names or imports the Engine.
ENGINE_PEER = ("kvflow.engine.peer", "kvflow.engine.context")


@pytest.mark.parametrize("module", ENGINE_PEER)
def test_the_peer_keeps_no_reference_to_the_engine(module):
    tree = MODULES[module]
    bad = sorted(f"imports {i}" for i in _imports(module, tree) if i.startswith("kvflow.engine.engine"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "_engine":
            bad.append(f"line {node.lineno}: ._engine")
        elif isinstance(node, ast.Name) and node.id == "Engine":
            bad.append(f"line {node.lineno}: Engine")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value == "Engine":
            bad.append(f"line {node.lineno}: 'Engine' (an annotation)")
    assert not bad, f"{module} reaches the Engine (give the Peer what it needs in PeerContext):\n" + \
        "\n".join(bad)


# engine/'s one door into paths/: the router, which makes the paths with the
# engine's PathContext (engine.py composes through it). A module left at an
# old import path to re-export a moved name holds no code that could use one.
PATHS_DOOR = ("kvflow.engine.router",)


def _only_reexports(tree: ast.Module) -> bool:
    """Nothing but a docstring, imports and `__all__`."""
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        return False
    return True


def test_inside_the_engine_only_the_router_imports_paths():
    assert all(d in MODULES for d in PATHS_DOOR), "the walk found no engine/router.py"
    bad = sorted((m, i) for m, tree in MODULES.items() if _layer(m) == "engine" and m not in PATHS_DOOR
                 and not _only_reexports(tree) for i in _imports(m, tree) if _inside(i, "paths"))
    assert not bad, f"engine/ imports paths/ outside engine/router.py (go through the router): {bad}"


def test_the_reexport_check_sees_code():
    # a walk that took every module for a re-export would pass the rule above
    assert _only_reexports(MODULES["kvflow.engine.relay"])
    assert not _only_reexports(MODULES["kvflow.engine.peer"])


# What decides a batch's path: a relay's route(), GPU memory's touches(),
# a provider's declared capabilities, a Route built, or a provider compared
# by identity (`peer._provider is engine._local`: ask its caps instead).
PATH_CALLS = {"route", "touches"}
PATH_CAPS = {"same_host", "remote", "memory"}
PROVIDER_ATTRS = {"_provider", "_local", "_tcp", "_rdma"}
ENGINE_ROUTER = "kvflow.engine.router"


def _decides_a_path(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PATH_CALLS:
        return f".{node.func.attr}()"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Route":
        return "Route()"
    if isinstance(node, ast.Attribute) and node.attr in PATH_CAPS and isinstance(node.value, ast.Attribute) \
            and node.value.attr == "caps":
        return f"caps.{node.attr}"
    if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
        sides = [node.left, *node.comparators]
        if any(isinstance(s, ast.Attribute) and s.attr in PROVIDER_ATTRS for s in sides) and \
                not any(isinstance(s, ast.Constant) and s.value is None for s in sides):
            return "a provider compared by identity"
    return None


def test_only_the_router_decides_a_batchs_path():
    assert ENGINE_ROUTER in MODULES, "the walk found no engine/router.py"
    bad = []
    for m, tree in MODULES.items():
        if _layer(m) != "engine" or m == ENGINE_ROUTER:
            continue
        for node in ast.walk(tree):
            why = _decides_a_path(node)
            if why:
                bad.append(f"{m}:{node.lineno} {why}")
    assert not bad, "a path decided outside kvflow/engine/router.py (ask the router):\n" + "\n".join(bad)


async def test_a_connected_peer_holds_no_engine(make_engine):
    """The same at run time: nothing a Peer or its PeerContext holds is an
    Engine (the context's hooks are the engine's bound methods, as a
    ProviderContext's are: calls, never the object to reach into)."""
    a = await make_engine(protocols=["local"])
    b = await make_engine(protocols=["local"])
    peer = await a.connect(b.address)
    ctx = peer._ctx
    held = [*vars(peer).values(), *(getattr(ctx, s) for s in type(ctx).__slots__ if hasattr(ctx, s))]
    assert not [v for v in held if isinstance(v, kvflow.Engine)]
    assert not hasattr(peer, "_engine")


def test_engine_metrics_reads_public_read_outs_only():
    """engine/metrics.py summarises what the engine and its peers show
    (engine.peers, pending_batches(), counters(); peer.channel_stats(),
    connections()), never their private attributes."""
    bad = [f"line {n.lineno}: .{n.attr}" for n in ast.walk(MODULES["kvflow.engine.metrics"])
           if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")]
    assert not bad, "engine/metrics.py reaches into privates:\n" + "\n".join(bad)
