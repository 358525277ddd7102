"""What the operator's ServiceAccount needs, derived from the code rather than copied from the chart.

Two sources, both read here rather than typed by hand:
- kvpersist's own API calls: every module `kvpersist run` imports is parsed (ast) and each call
  that can reach the API server is mapped to (apiGroup, resource[/subresource], verb): the
  kubernetes client's typed methods (`list_namespaced_pod`, ...) by the path and HTTP method the
  client itself sends, and the dynamic client (`resources.get(api_version=, kind=)` then `.get`,
  `.create`, `.server_side_apply`, `request("patch", res.path() + "/status")`, ...) by the same
  rules. Wrappers (kvpersist.controller.kube.get takes the kind as an argument) are followed to their
  callers, loop variables to their tuples and manifests to the builder that returns them.
- kopf's own requests, from the handlers kvpersist registers (kopf's registry) and the settings
  its startup handler chooses: list + watch of every watched resource, patch of the resources it
  keeps progress on, Events it posts, the peering object of the mode.

A call that may reach the API server and that this mapping does not understand raises
UnknownCall: a new call must be understood (or the mapping extended), never skipped.
`python -m tests.rbac_needs --write-docs` rewrites the table in docs/security.md.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import inspect
import itertools
import logging
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO / "operator" / "kvpersist"
CHART = REPO / "charts" / "kvpersist"
DOCS = REPO / "docs" / "security.md"
ENTRY = "kvpersist.controller.handlers"  # what `kvpersist run` imports (with what it imports in turn)
KUBE = "kvpersist.controller.kube"  # the operator's wrappers of the API server's calls
# Modules that call the API server but never as the operator's ServiceAccount.
OTHER_IDENTITIES = {"kvpersist.admin": "`kvpersist status/report/gc`: run by a person with their own kubeconfig",
                    "kvpersist.plancmd": "`kvpersist plan`: run by a person with their own kubeconfig"}
# Other projects' APIs the operator uses where installed (spec.vllm.inferencePool): their kinds' plurals.
FOREIGN_CRDS = (REPO / "tests" / "e2e" / "data" / "inferencepools.inference.networking.k8s.io.yaml",)
MODES = ("clusterwide", "namespaced")  # the chart: watchNamespaces empty, or set
WATCHED = ("team-a", "team-b")  # watchNamespaces when the chart is rendered in namespaced mode
# What Kubernetes grants every authenticated user (the ClusterRole system:basic-user): the chart
# need not, and `kubectl auth can-i --list` shows them for a ServiceAccount without any binding.
DEFAULT_GRANTS: frozenset[Grant] = frozenset({
    ("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
    ("authorization.k8s.io", "selfsubjectrulesreviews", "create"),
    ("authentication.k8s.io", "selfsubjectreviews", "create"),
})

Grant = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)
DYNAMIC_METHODS = {"get", "create", "delete", "patch", "replace", "server_side_apply", "watch"}
KOPF_EVENT_FUNCTIONS = {"event", "info", "warn", "exception"}


class UnknownCall(Exception):
    """A call that may reach the API server and that the mapping cannot turn into grants."""


class _Unresolved(Exception):
    """A value the resolver cannot know statically (fatal only where a grant depends on it)."""


class _NoCallers(Exception):
    """A parameter the grant depends on, of a function nothing in the operator calls."""


# ---------------------------------------------------------------------------------------------
# The kubernetes client's own knowledge: paths and methods of its typed APIs, and the kinds.


@dataclass(frozen=True)
class Route:
    """One typed client method: its class, HTTP method and path template."""

    cls: str
    http: str
    path: str


@functools.cache
def typed_routes() -> dict[str, list[Route]]:
    """method name -> the routes of every typed API class that has it, read from the client's source."""
    import kubernetes.client.api as apis

    # Two generations of the generated client: `_<method>_serialize(... method='GET', resource_path='...')`
    # (kubernetes >= 32) and `<method>_with_http_info` calling `call_api('/path', 'GET', ...)` (older).
    serialize = re.compile(r"def _(\w+)_serialize\(.*?method='(\w+)',\s*resource_path='([^']+)'", re.S)
    with_http_info = re.compile(r"def (\w+)_with_http_info\(.*?call_api\(\s*'([^']+)',\s*'(\w+)'", re.S)
    out: dict[str, list[Route]] = {}
    for path in sorted(Path(apis.__file__).parent.glob("*_api.py")):
        text = path.read_text()
        match = re.search(r"^class (\w+)[(:]", text, re.M)
        if not match:
            continue
        for method, http, route in serialize.findall(text):
            out.setdefault(method, []).append(Route(match.group(1), http, route))
        for method, route, http in with_http_info.findall(text):
            out.setdefault(method, []).append(Route(match.group(1), http, route))
    return out


def _split_path(path: str) -> tuple[str, str, list[str]]:
    """/api/v1/namespaces/{namespace}/pods/{name}/status -> ("", "v1", ["pods", "{name}", "status"])."""
    parts = path.strip("/").split("/")
    if parts[0] == "api" and len(parts) >= 2:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[0] == "apis" and len(parts) >= 3:
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return "", "", []
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    elif rest[:1] == ["watch"]:
        rest = rest[1:]
    return group, version, rest


@functools.cache
def kinds() -> dict[tuple[str, str, str], str]:
    """(group, version, kind in lower case) -> plural: the built-in kinds from the typed client's
    read methods, the custom ones from the chart's CRDs."""
    out: dict[tuple[str, str, str], str] = {}
    for method, routes in typed_routes().items():
        match = re.fullmatch(r"read_(?:namespaced_)?(\w+?)", method)
        for route in routes:
            group, version, rest = _split_path(route.path)
            if match and len(rest) == 2 and rest[1] == "{name}" and not rest[0].startswith("{"):
                out[(group, version, match.group(1).replace("_", ""))] = rest[0]
    for crd in _chart_crds():
        names = crd["spec"]["names"]
        for version in crd["spec"]["versions"]:
            out[(crd["spec"]["group"], version["name"], names["kind"].lower())] = names["plural"]
    return out


@functools.cache
def _chart_crds() -> tuple[dict[str, Any], ...]:
    """The chart's CRDs: the kopf peering ones in crds/, the KVCacheNamespace one that
    templates/crd.yaml renders from files/; and the APIs of others the operator writes where they
    are installed (FOREIGN_CRDS: InferencePool), by the stand-ins the e2e tests install."""
    paths = sorted((CHART / "crds").glob("*.yaml")) + sorted((CHART / "files").glob("*.kvpersist.dev.yaml"))
    paths += list(FOREIGN_CRDS)
    return tuple(d for p in paths for d in yaml.safe_load_all(p.read_text()) if d)


def has_status_subresource(group: str, plural: str) -> bool:
    """Whether the chart's CRD serves /status separately (kopf then patches status there)."""
    return any(c["spec"]["group"] == group and c["spec"]["names"]["plural"] == plural
               and any("status" in (v.get("subresources") or {}) for v in c["spec"]["versions"]) for c in _chart_crds())


def plural_of(api_version: str, kind: str) -> tuple[str, str]:
    """(group, plural) of an apiVersion and kind, or UnknownCall."""
    group, _, version = api_version.rpartition("/")
    try:
        return group, kinds()[(group, version, kind.lower())]
    except KeyError:
        raise UnknownCall(f"kind {kind} of {api_version} is neither in the kubernetes client nor in the chart's CRDs") from None


# ---------------------------------------------------------------------------------------------
# The operator's modules, parsed.


@dataclass(eq=False)
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local name -> dotted target
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)  # top level only
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(REPO / "operator"))


_OVERRIDES: dict[str, str] = {}  # module -> source to analyse instead of the file's (tests)


@functools.cache
def module(name: str) -> Module:
    path = PACKAGE_DIR.parent / (name.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE_DIR.parent / name.replace(".", "/") / "__init__.py"
    tree = ast.parse(_OVERRIDES.get(name) or path.read_text(), str(path))
    mod = Module(name, path, tree)
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            mod.parents[child] = node
        if isinstance(node, ast.Import):
            for alias in node.names:
                mod.imports[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                mod.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            mod.functions[node.name] = node
    return mod


def _is_kvpersist_module(dotted: str) -> bool:
    return dotted.split(".")[0] == "kvpersist" and (
        (PACKAGE_DIR.parent / (dotted.replace(".", "/") + ".py")).exists()
        or (PACKAGE_DIR.parent / dotted.replace(".", "/") / "__init__.py").exists())


@functools.cache
def operator_modules() -> tuple[str, ...]:
    """The kvpersist modules `kvpersist run` loads: ENTRY and everything it imports, transitively."""
    seen: list[str] = []
    todo = [ENTRY]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        for target in module(name).imports.values():
            for candidate in (target, target.rpartition(".")[0]):
                if _is_kvpersist_module(candidate) and candidate not in seen:
                    todo.append(candidate)
                    break
    return tuple(sorted(seen))


def all_modules() -> list[str]:
    out = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _enclosing_function(mod: Module, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    while node in mod.parents:
        node = mod.parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return node
    return None


def _qualname(mod: Module, func: ast.AST | None) -> str:
    names = []
    node: ast.AST | None = func
    while node is not None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        node = mod.parents.get(node)
    return ".".join([mod.name.removeprefix("kvpersist."), *reversed(names)]) if names else mod.name.removeprefix("kvpersist.")


def _callee(mod: Module, func: ast.expr) -> tuple[str, str] | None:
    """(module, function) of a call's target when it is a kvpersist module-level function."""
    if isinstance(func, ast.Name):
        if func.id in mod.functions:
            return mod.name, func.id
        target = mod.imports.get(func.id, "")
        owner, _, name = target.rpartition(".")
        if _is_kvpersist_module(owner) and name in module(owner).functions:
            return owner, name
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner = mod.imports.get(func.value.id, "")
        if _is_kvpersist_module(owner) and func.attr in module(owner).functions:
            return owner, func.attr
    return None


@dataclass(frozen=True)
class Site:
    """Where a function is called: for the reasons a grant is needed."""

    module: str
    line: int
    function: str
    callee: str = ""  # the function called there


@functools.cache
def call_sites(owner: str, name: str) -> tuple[tuple[Site, ast.Call], ...]:
    """Every direct call of owner.name in the operator's modules."""
    out = []
    for mod_name in operator_modules():
        mod = module(mod_name)
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Call) and _callee(mod, node.func) == (owner, name) and reached(mod, node):
                site = Site(mod_name, node.lineno, _qualname(mod, _enclosing_function(mod, node)),
                            _qualname(module(owner), module(owner).functions[name]))
                out.append((site, node))
    return tuple(out)


@functools.cache
def referenced_as_value(owner: str, name: str) -> bool:
    """Whether owner.name is passed around (executor, callback) rather than only called."""
    for mod_name in operator_modules():
        mod = module(mod_name)
        for node in ast.walk(mod.tree):
            parent = mod.parents.get(node)
            if isinstance(node, ast.Name | ast.Attribute) and not (isinstance(parent, ast.Call) and parent.func is node) \
                    and isinstance(node.ctx, ast.Load) and _callee(mod, node) == (owner, name) and reached(mod, node):
                return True
    return False


def _unit(mod: Module, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The module-level function or method a node belongs to (None: module-level code)."""
    unit = None
    while node in mod.parents:
        parent = mod.parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (
                parent is mod.tree or (isinstance(parent, ast.ClassDef) and mod.parents.get(parent) is mod.tree)):
            unit = node
        node = parent
    return unit


def _roots() -> Iterator[tuple[str, str]]:
    """(module, qualified name) of the functions kopf calls: the handlers kvpersist registers."""
    import kopf

    importlib.import_module(ENTRY)
    registry = kopf.get_default_registry()
    for reg in (registry._activities, registry._indexing, registry._watching, registry._changing, registry._spawning,
                registry._webhooks):
        for handler in reg.get_all_handlers():
            fn = inspect.unwrap(handler.fn)
            if fn.__module__.startswith("kvpersist"):
                yield fn.__module__, fn.__qualname__


def _defs(mod: Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Qualified name -> def, for module-level functions and methods."""
    out: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = dict(mod.functions)
    for node in mod.tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    out[f"{node.name}.{item.name}"] = item
    return out


def _referenced(mod: Module, node: ast.AST) -> Iterator[tuple[str, str]]:
    """The kvpersist functions and classes (as their methods) a name or attribute stands for."""
    if not isinstance(node, ast.Name | ast.Attribute):
        return
    callee = _callee(mod, node)
    if callee is not None:
        yield callee
        return
    owner, name = "", ""
    if isinstance(node, ast.Name):
        target = mod.imports.get(node.id, "")
        owner, name = (target.rpartition(".")[0], target.rpartition(".")[2]) if target else (mod.name, node.id)
    elif isinstance(node.value, ast.Name):
        owner, name = mod.imports.get(node.value.id, ""), node.attr
    if _is_kvpersist_module(owner):
        for qual in _defs(module(owner)):
            if qual.startswith(f"{name}."):
                yield owner, qual


@functools.cache
def reachable() -> frozenset[tuple[str, str]]:
    """(module, qualified name) of every function the running operator may call: from kopf's
    handlers and the modules' top-level code, through every reference (a call, or a function
    handed to an executor or partial)."""
    todo: list[tuple[str, str]] = list(_roots())
    for name in operator_modules():
        mod = module(name)
        for node in ast.walk(mod.tree):
            if _unit(mod, node) is None:
                todo.extend(_referenced(mod, node))
    seen: set[tuple[str, str]] = set()
    while todo:
        key = todo.pop()
        if key in seen or not _is_kvpersist_module(key[0]) or key[1] not in _defs(module(key[0])):
            continue
        seen.add(key)
        mod = module(key[0])
        for node in ast.walk(_defs(mod)[key[1]]):
            todo.extend(_referenced(mod, node))
    return frozenset(seen)


def reached(mod: Module, node: ast.AST) -> bool:
    """Whether node is in code the running operator may execute."""
    unit = _unit(mod, node)
    if unit is None:
        return True
    parent = mod.parents.get(unit)
    qual = f"{parent.name}.{unit.name}" if isinstance(parent, ast.ClassDef) else unit.name
    return (mod.name, qual) in reachable()


# ---------------------------------------------------------------------------------------------
# The resolver: what an expression may be, with the choices (call site, loop element, branch)
# each value assumes, so values of one expression combine only with consistent ones of another.

Assumptions = frozenset[tuple[Any, Any]]


@dataclass(frozen=True)
class Val:
    value: Any
    assumes: Assumptions = frozenset()


@dataclass(frozen=True)
class Ref:
    """A literal (dict, list, tuple) left unevaluated, to be indexed or iterated in its context."""

    node: ast.expr
    ctx: Ctx


@dataclass(frozen=True)
class Handle:
    """A dynamic client resource: resources.get(api_version=, kind=)."""

    api_version: str
    kind: str


class DynamicClientValue:
    """kubernetes.dynamic.DynamicClient(...)."""


@dataclass(frozen=True)
class Instance:
    """A kvpersist dataclass as constructed (e.g. kvpersist.controller.decision.Decision(...)): its
    fields are the arguments of that call, or the class's defaults."""

    cls: type
    call: ast.Call
    ctx: Ctx


@dataclass(eq=False)
class Ctx:
    """One function as evaluated: bound to one call (args) or to any of its callers (args None)."""

    mod: Module
    func: ast.FunctionDef | ast.AsyncFunctionDef | None
    args: dict[str, tuple[ast.expr, Ctx]] | None = None
    outer: Ctx | None = None  # the enclosing function's context, for a nested def

    def __hash__(self) -> int:
        return id(self)


def _consistent(*sets: Assumptions) -> Assumptions | None:
    merged: dict[Any, Any] = {}
    for assumed in sets:
        for key, option in assumed:
            if merged.setdefault(key, option) != option:
                return None
    return frozenset(merged.items())


def combine(*groups: list[Val]) -> Iterator[tuple[tuple[Any, ...], Assumptions]]:
    """Every consistent combination of one value from each group."""
    for combo in itertools.product(*groups):
        assumed = _consistent(*(v.assumes for v in combo))
        if assumed is not None:
            yield tuple(v.value for v in combo), assumed


class Resolver:
    def __init__(self) -> None:
        self._unbound: dict[Any, Ctx] = {}
        self._bound: dict[tuple[int, int], Ctx] = {}
        self._stack: list[tuple[int, int]] = []

    def ctx_of(self, mod: Module, node: ast.AST) -> Ctx:
        """The unbound context of the function around node (module level when none)."""
        func = _enclosing_function(mod, node)
        key = (mod.name, id(func))
        if key not in self._unbound:
            outer = self.ctx_of(mod, func) if func is not None and _enclosing_function(mod, func) is not None else None
            self._unbound[key] = Ctx(mod, func, None, outer)
        return self._unbound[key]

    def _call_ctx(self, call: ast.Call, caller: Ctx, owner: str, name: str) -> Ctx:
        key = (id(caller), id(call))
        if key not in self._bound:
            mod = module(owner)
            func = mod.functions[name]
            self._bound[key] = Ctx(mod, func, _bind(func, call, caller))
        return self._bound[key]

    # -- expressions

    def resolve(self, expr: ast.expr, ctx: Ctx) -> list[Val]:
        key = (id(expr), id(ctx))
        if key in self._stack:
            raise _Unresolved(f"recursion at {ctx.mod.rel}:{expr.lineno}")
        self._stack.append(key)
        try:
            return self._resolve(expr, ctx)
        finally:
            self._stack.pop()

    def _resolve(self, expr: ast.expr, ctx: Ctx) -> list[Val]:
        if isinstance(expr, ast.Constant):
            return [Val(expr.value)]
        if isinstance(expr, ast.Name):
            return self._name(expr.id, ctx, expr)
        if isinstance(expr, ast.Attribute):
            out = []
            for base in self.resolve(expr.value, ctx):
                if isinstance(base.value, Instance):
                    out.extend(Val(v.value, v.assumes | base.assumes) for v in self._field(base.value, expr.attr))
                    continue
                if isinstance(base.value, Ref | Handle | DynamicClientValue) or base.value is None:
                    raise _Unresolved(f"attribute {expr.attr} at {ctx.mod.rel}:{expr.lineno}")
                try:
                    out.append(Val(getattr(base.value, expr.attr), base.assumes))
                except AttributeError:
                    raise _Unresolved(f"attribute {expr.attr} at {ctx.mod.rel}:{expr.lineno}") from None
            return out
        if isinstance(expr, ast.Subscript):
            return self._subscript(expr, ctx)
        if isinstance(expr, ast.IfExp):
            choice = (id(ctx), id(expr))
            return [Val(v.value, v.assumes | {(choice, i)}) for i, branch in enumerate((expr.body, expr.orelse))
                    for v in self.resolve(branch, ctx)]
        if isinstance(expr, ast.Dict | ast.List | ast.Tuple):
            return [Val(Ref(expr, ctx))]
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            return [Val(a + b, assumed) for (a, b), assumed in combine(self.resolve(expr.left, ctx), self.resolve(expr.right, ctx))
                    if isinstance(a, str) and isinstance(b, str)]
        if isinstance(expr, ast.Call):
            return self._call(expr, ctx)
        raise _Unresolved(f"{type(expr).__name__} at {ctx.mod.rel}:{expr.lineno}")

    def _name(self, name: str, ctx: Ctx, node: ast.expr) -> list[Val]:
        scope: Ctx | None = ctx
        while scope is not None and scope.func is not None:
            bindings = _bindings(scope.func).get(name)
            if bindings:
                return self._bound_name(name, bindings, scope)
            scope = scope.outer
        mod = ctx.mod
        if name in mod.functions:
            return [Val(("function", mod.name, name))]
        target = mod.imports.get(name)
        if target is not None:
            owner, _, attr = target.rpartition(".")
            if _is_kvpersist_module(owner) and attr in module(owner).functions:
                return [Val(("function", owner, attr))]
            with contextlib.suppress(ImportError):
                return [Val(importlib.import_module(target))]
            return [Val(getattr(importlib.import_module(owner), attr))]
        try:
            return [Val(getattr(importlib.import_module(mod.name), name))]
        except AttributeError:
            raise _Unresolved(f"name {name} at {mod.rel}:{node.lineno}") from None

    def _bound_name(self, name: str, bindings: list[tuple[str, Any, tuple[int, ...]]], ctx: Ctx) -> list[Val]:
        out: list[Val] = []
        for i, (kind, source, path) in enumerate(bindings):
            tag = frozenset({((id(ctx), "bind", name), i)}) if len(bindings) > 1 else frozenset()
            if kind == "param":
                values = self._param(name, source, ctx)
            elif kind == "assign":
                values = [v for whole in self.resolve(source, ctx) for v in self._destructure(whole, path)]
            else:  # for: one value per element, each a choice of its own
                values = []
                for whole in self.resolve(source, ctx):
                    for j, element in enumerate(self.iterate(whole)):
                        chosen = Val(element.value, element.assumes | {((id(ctx), id(source)), j)})
                        values.extend(self._destructure(chosen, path))
            out.extend(Val(v.value, v.assumes | tag) for v in values)
        return out

    def _param(self, name: str, default: ast.expr | None, ctx: Ctx) -> list[Val]:
        assert ctx.func is not None
        if ctx.args is not None:
            if name in ctx.args:
                expr, caller = ctx.args[name]
                return self.resolve(expr, caller)
            if default is None:
                raise _Unresolved(f"parameter {name} of {ctx.func.name} not passed")
            return self.resolve(default, ctx)
        owner = ctx.mod.name
        if ctx.func.name not in ctx.mod.functions or ctx.mod.functions[ctx.func.name] is not ctx.func:
            raise _Unresolved(f"parameter {name} of {_qualname(ctx.mod, ctx.func)} (a method or nested function)")
        sites = call_sites(owner, ctx.func.name)
        if not sites:
            if referenced_as_value(owner, ctx.func.name):
                raise _Unresolved(f"{_qualname(ctx.mod, ctx.func)} is passed as a value: its {name} cannot be followed")
            raise _NoCallers(_qualname(ctx.mod, ctx.func))
        out = []
        for site, call in sites:
            caller = self.ctx_of(module(site.module), call)
            bound = self._call_ctx(call, caller, owner, ctx.func.name)
            for v in self._param(name, default, bound):
                out.append(Val(v.value, v.assumes | {((id(ctx), "site"), site)}))
        return out

    def _destructure(self, value: Val, path: tuple[int, ...]) -> list[Val]:
        if not path:
            return [value]
        elements = list(self.iterate(value))
        if path[0] >= len(elements):
            raise _Unresolved("unpacking")
        return self._destructure(elements[path[0]], path[1:])

    def iterate(self, value: Val) -> Iterator[Val]:
        """The elements of a list or tuple value (a literal's resolved in its context)."""
        v = value.value
        if isinstance(v, Ref) and isinstance(v.node, ast.List | ast.Tuple):
            for element in v.node.elts:
                if isinstance(element, ast.Starred):
                    raise _Unresolved(f"starred element at {v.ctx.mod.rel}:{element.lineno}")
                for resolved in self.resolve(element, v.ctx):
                    yield Val(resolved.value, resolved.assumes | value.assumes)
        elif isinstance(v, list | tuple):
            for element in v:
                yield Val(element, value.assumes)
        else:
            raise _Unresolved(f"iteration over {type(v).__name__}")

    def _subscript(self, expr: ast.Subscript, ctx: Ctx) -> list[Val]:
        out = []
        for (base, index), assumed in combine(self.resolve(expr.value, ctx), self.resolve(expr.slice, ctx)):
            if base is None:
                continue  # e.g. a builder that returns None: never indexed at run time
            if isinstance(base, Ref) and isinstance(base.node, ast.Dict):
                for k, v in zip(base.node.keys, base.node.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value == index:
                        out.extend(Val(r.value, r.assumes | assumed) for r in self.resolve(v, base.ctx))
                        break
                else:
                    raise _Unresolved(f"key {index!r} of the dict at {base.ctx.mod.rel}:{base.node.lineno}")
            elif isinstance(base, Ref):
                elements = list(self.iterate(Val(base, assumed)))
                out.append(elements[index])
            elif isinstance(base, dict | list | tuple | str):
                out.append(Val(base[index], assumed))
            else:
                raise _Unresolved(f"subscript at {ctx.mod.rel}:{expr.lineno}")
        return out

    def _field(self, inst: Instance, attr: str) -> list[Val]:
        """One field of a constructed dataclass: its keyword, a key of a **literal dict, its
        position, or the class's default."""
        for kw in inst.call.keywords:
            if kw.arg == attr:
                return self.resolve(kw.value, inst.ctx)
        for kw in inst.call.keywords:
            if kw.arg is None:
                for mapping in self.resolve(kw.value, inst.ctx):
                    node = mapping.value.node if isinstance(mapping.value, Ref) else None
                    if not isinstance(node, ast.Dict):
                        raise _Unresolved(f"**{type(mapping.value).__name__} at {inst.ctx.mod.rel}:{inst.call.lineno}")
                    for k, v in zip(node.keys, node.values, strict=True):
                        if isinstance(k, ast.Constant) and k.value == attr:
                            return [Val(r.value, r.assumes | mapping.assumes) for r in self.resolve(v, mapping.value.ctx)]
        fields = dataclasses.fields(inst.cls)
        names = [f.name for f in fields]
        if attr not in names:
            raise _Unresolved(f"{inst.cls.__name__}.{attr} at {inst.ctx.mod.rel}:{inst.call.lineno}")
        i = names.index(attr)
        if i < len(inst.call.args):
            if any(isinstance(a, ast.Starred) for a in inst.call.args[:i + 1]):
                raise _Unresolved(f"starred argument at {inst.ctx.mod.rel}:{inst.call.lineno}")
            return self.resolve(inst.call.args[i], inst.ctx)
        f = fields[i]
        if f.default is not dataclasses.MISSING:
            return [Val(f.default)]
        if f.default_factory is not dataclasses.MISSING:
            return [Val(f.default_factory())]
        raise _Unresolved(f"{inst.cls.__name__}.{attr} not given at {inst.ctx.mod.rel}:{inst.call.lineno}")

    def _call(self, call: ast.Call, ctx: Ctx) -> list[Val]:
        func = call.func
        cls = _dataclass_called(ctx.mod, func)
        if cls is not None:
            return [Val(Instance(cls, call, ctx))]
        if isinstance(func, ast.Name) and func.id in ("tuple", "list") and len(call.args) == 1 and not call.keywords:
            return self.resolve(call.args[0], ctx)  # a copy of a sequence: the same elements
        if isinstance(func, ast.Attribute) and func.attr == "get" and isinstance(func.value, ast.Attribute) \
                and func.value.attr == "resources":
            kw = {k.arg: k.value for k in call.keywords}
            if "api_version" not in kw or "kind" not in kw:
                raise UnknownCall(f"resources.get without api_version= and kind= at {ctx.mod.rel}:{call.lineno}")
            return [Val(Handle(av, k), assumed) for (av, k), assumed in
                    combine(self.resolve(kw["api_version"], ctx), self.resolve(kw["kind"], ctx))]
        if _is_dynamic_client_constructor(ctx.mod, func):
            return [Val(DynamicClientValue())]
        callee = _callee(ctx.mod, func)
        if callee is None:
            raise _Unresolved(f"call at {ctx.mod.rel}:{call.lineno}")
        bound = self._call_ctx(call, ctx, *callee)
        out = []
        returns = _returns(bound.func)  # type: ignore[arg-type]
        for i, ret in enumerate(returns):
            tag = ((id(bound), "return"), i)
            out.extend(Val(v.value, v.assumes | {tag}) for v in self.resolve(ret, bound))
        return out


def _dataclass_called(mod: Module, func: ast.expr) -> type | None:
    """The kvpersist dataclass a call constructs, or None."""
    if isinstance(func, ast.Name):
        local = any(isinstance(n, ast.ClassDef) and n.name == func.id for n in mod.tree.body)
        owner, _, name = f"{mod.name}.{func.id}".rpartition(".") if local else mod.imports.get(func.id, "").rpartition(".")
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner, name = mod.imports.get(func.value.id, ""), func.attr
    else:
        return None
    if not owner or not _is_kvpersist_module(owner):
        return None
    cls = getattr(importlib.import_module(owner), name, None)
    return cls if isinstance(cls, type) and dataclasses.is_dataclass(cls) else None


def _is_dynamic_client_constructor(mod: Module, func: ast.expr) -> bool:
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name == "DynamicClient"


def _bind(func: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call, caller: Ctx) -> dict[str, tuple[ast.expr, Ctx]]:
    params = [a.arg for a in func.args.posonlyargs + func.args.args]
    out: dict[str, tuple[ast.expr, Ctx]] = {}
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            raise _Unresolved(f"*args at {caller.mod.rel}:{call.lineno}")
        if i < len(params):
            out[params[i]] = (arg, caller)
    for kw in call.keywords:
        if kw.arg is None:
            raise _Unresolved(f"**kwargs at {caller.mod.rel}:{call.lineno}")
        out[kw.arg] = (kw.value, caller)
    return out


def _returns(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.expr]:
    out = []
    for node in _own_nodes(func):
        if isinstance(node, ast.Return):
            out.append(node.value if node.value is not None else ast.Constant(None, lineno=node.lineno))
    return out


def _own_nodes(func: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function body, not those of functions or classes nested in it."""
    todo = list(ast.iter_child_nodes(func))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))


@functools.cache
def _bindings(func: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, list[tuple[str, Any, tuple[int, ...]]]]:
    """name -> how the function binds it: ("param", default, ()), ("assign", value, path) or
    ("for", iterable, path), path indexing into a tuple target."""
    out: dict[str, list[tuple[str, Any, tuple[int, ...]]]] = {}
    args = func.args
    positional = args.posonlyargs + args.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for a, d in zip(positional, defaults, strict=True):
        out.setdefault(a.arg, []).append(("param", d, ()))
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.setdefault(a.arg, []).append(("param", d, ()))
    for extra in (args.vararg, args.kwarg):
        if extra is not None:
            out.setdefault(extra.arg, []).append(("param", None, ()))

    def targets(target: ast.expr, path: tuple[int, ...]) -> Iterator[tuple[str, tuple[int, ...]]]:
        if isinstance(target, ast.Name):
            yield target.id, path
        elif isinstance(target, ast.Tuple | ast.List):
            for i, element in enumerate(target.elts):
                yield from targets(element, (*path, i))

    for node in _own_nodes(func):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name, path in targets(target, ()):
                    out.setdefault(name, []).append(("assign", node.value, path))
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and isinstance(node.target, ast.Name) and node.value is not None:
            out.setdefault(node.target.id, []).append(("assign", node.value, ()))
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            for name, path in targets(node.target, ()):
                out.setdefault(name, []).append(("for", node.iter, path))
        elif isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                if item.optional_vars is not None:
                    for name, _ in targets(item.optional_vars, ()):
                        out.setdefault(name, []).append(("assign", ast.Constant(None, lineno=node.lineno), ()))
        elif isinstance(node, ast.AugAssign | ast.ExceptHandler | ast.Global | ast.Nonlocal):
            name = getattr(node, "name", None) or (node.target.id if isinstance(node, ast.AugAssign)
                                                   and isinstance(node.target, ast.Name) else None)
            if name:
                out.setdefault(name, []).append(("assign", ast.Constant(None, lineno=node.lineno), ()))
    return out


# ---------------------------------------------------------------------------------------------
# Calls that reach the API server.


@dataclass(frozen=True)
class Use:
    """One grant the code needs, and where: the call, and the callers it was followed through."""

    grant: Grant
    call: Site
    through: tuple[Site, ...] = ()

    def where(self) -> str:
        """A stable description (functions, callee first, no line numbers) for the docs."""
        chain, current, left = [self.call.function], self.call.function, list(self.through)
        while left:
            step = next((s for s in left if current.startswith(s.callee)), left[0])
            left.remove(step)
            current = step.function
            chain.append(current)
        return " ← ".join(dict.fromkeys(chain))


def _handle_shaped(expr: ast.expr, mod: Module, depth: int = 0) -> bool:
    """Whether an expression builds a dynamic client resource (structurally: values not needed)."""
    if depth > 6:
        return False
    if isinstance(expr, ast.Call):
        func = expr.func
        if isinstance(func, ast.Attribute) and func.attr == "get" and isinstance(func.value, ast.Attribute) \
                and func.value.attr == "resources":
            return True
        callee = _callee(mod, func)
        if callee is not None:
            owner = module(callee[0])
            return any(_handle_shaped(r, owner, depth + 1) for r in _returns(owner.functions[callee[1]]))
    if isinstance(expr, ast.Name):
        func = _enclosing_function(mod, expr)
        if func is not None:
            return any(kind == "assign" and _handle_shaped(src, mod, depth + 1)
                       for kind, src, _ in _bindings(func).get(expr.id, []))
    return False


def _client_shaped(expr: ast.expr, mod: Module, depth: int = 0) -> bool:
    """Whether an expression is a kubernetes.dynamic.DynamicClient."""
    if depth > 6 or not isinstance(expr, ast.Call | ast.Name):
        return False
    if isinstance(expr, ast.Call):
        if _is_dynamic_client_constructor(mod, expr.func):
            return True
        callee = _callee(mod, expr.func)
        if callee is None:
            return False
        owner = module(callee[0])
        return any(_client_shaped(r, owner, depth + 1) for r in _returns(owner.functions[callee[1]]))
    func = _enclosing_function(mod, expr)
    return func is not None and any(kind == "assign" and _client_shaped(src, mod, depth + 1)
                                    for kind, src, _ in _bindings(func).get(expr.id, []))


HTTP_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


def _verb(http: str, named: bool, watch: bool = False) -> list[str]:
    verb = HTTP_VERBS[http.upper()]
    if verb == "get" and not named:
        return ["list", "watch"] if watch else ["list"]
    if verb == "delete" and not named:
        return ["deletecollection"]
    return [verb]


def _kw(call: ast.Call, name: str, position: int | None = None) -> ast.expr | None:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    if position is not None and len(call.args) > position:
        return call.args[position]
    return None


def _given(expr: ast.expr | None) -> bool:
    return expr is not None and not (isinstance(expr, ast.Constant) and expr.value is None)


def _true(expr: ast.expr | None) -> bool:
    return expr is not None and not (isinstance(expr, ast.Constant) and not expr.value)


class Finder:
    """Walks the operator's modules and turns every API call into Uses."""

    def __init__(self) -> None:
        self.r = Resolver()
        self.uses: list[Use] = []
        self.unused_wrappers: set[str] = set()

    def run(self) -> list[Use]:
        for name in operator_modules():
            mod = module(name)
            for node in ast.walk(mod.tree):
                if not reached(mod, node):
                    continue
                if isinstance(node, ast.Call):
                    self._call(mod, node)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    parent = mod.parents.get(node)
                    if not (isinstance(parent, ast.Call) and parent.func is node) and self._typed_name(node.attr):
                        self._typed(mod, node, None)  # e.g. watch.Watch().stream(api.list_namespaced_pod, ...)
        return self.uses

    @staticmethod
    def _typed_name(attr: str) -> str | None:
        for suffix in ("_with_http_info", "_without_preload_content", ""):
            name = attr.removesuffix(suffix) if suffix else attr
            if name in typed_routes() and any(_split_path(r.path)[2] for r in typed_routes()[name]):
                return name
        return None

    def _call(self, mod: Module, call: ast.Call) -> None:
        func = call.func
        where = f"{mod.rel}:{call.lineno}"
        if not isinstance(func, ast.Attribute):
            return
        if func.attr in ("call_api", "param_serialize"):
            raise UnknownCall(f"{where}: raw kubernetes ApiClient.{func.attr}: use a typed or dynamic call")
        if isinstance(func.value, ast.Name) and mod.imports.get(func.value.id) == "kopf" and func.attr in KOPF_EVENT_FUNCTIONS:
            self._add(mod, call, [(("", "events", "create"), frozenset())])
            return
        if self._typed_name(func.attr):
            self._typed(mod, func, call)
        elif func.attr in DYNAMIC_METHODS and _handle_shaped(func.value, mod):
            self._dynamic(mod, call, func.value, func.attr)
        elif _client_shaped(func.value, mod):
            if func.attr == "request":
                self._request(mod, call)
            elif func.attr in DYNAMIC_METHODS:
                handle = _kw(call, "resource", 0)
                if handle is None or not _handle_shaped(handle, mod):
                    raise UnknownCall(f"{where}: DynamicClient.{func.attr} without a resource the mapping can follow")
                rest = ast.Call(func=call.func, args=call.args[1:], keywords=[k for k in call.keywords if k.arg != "resource"])
                self._dynamic(mod, rest, handle, func.attr, line=call.lineno)
            elif func.attr != "resources":
                raise UnknownCall(f"{where}: DynamicClient.{func.attr} is not in the mapping")

    def _resolve_grants(self, mod: Module, node: ast.AST, compute: Any) -> list[tuple[Grant, Assumptions]]:
        """compute(resolver, ctx) -> [(grant, assumptions)], or UnknownCall naming the call."""
        ctx = self.r.ctx_of(mod, node)
        try:
            return compute(ctx)
        except _NoCallers as exc:
            self.unused_wrappers.add(str(exc))
            return []
        except _Unresolved as exc:
            raise UnknownCall(f"{mod.rel}:{getattr(node, 'lineno', '?')}: cannot tell which resource this API call "
                              f"reaches ({exc})") from None

    def _dynamic(self, mod: Module, call: ast.Call, receiver: ast.expr, method: str, line: int | None = None) -> None:
        named = _given(_kw(call, "name", 0))
        watch = _true(_kw(call, "watch"))
        verbs = {"get": ["watch"] if watch else (["get"] if named else ["list"]), "create": ["create"],
                 "delete": ["delete"] if named else ["deletecollection"], "patch": ["patch"], "replace": ["update"],
                 "server_side_apply": ["patch", "create"],  # apply creates a missing object: both are checked
                 "watch": ["list", "watch"]}[method]

        self._add(mod, call, self._resolve_grants(mod, receiver, self._on_handle(receiver, verbs)), line)

    def _request(self, mod: Module, call: ast.Call) -> None:
        where = f"{mod.rel}:{call.lineno}"
        if len(call.args) < 2 or not isinstance(call.args[0], ast.Constant):
            raise UnknownCall(f"{where}: DynamicClient.request needs a constant method and a path")
        http, path = call.args[0].value, _follow(call.args[1], mod)
        suffix = ""
        if isinstance(path, ast.BinOp) and isinstance(path.op, ast.Add) and isinstance(path.right, ast.Constant):
            path, suffix = _follow(path.left, mod), str(path.right.value)
        if not (isinstance(path, ast.Call) and isinstance(path.func, ast.Attribute) and path.func.attr == "path"
                and _handle_shaped(path.func.value, mod)):
            raise UnknownCall(f"{where}: DynamicClient.request with a path not of the form resource.path(...)[ + '/sub']")
        sub = suffix.strip("/")
        if "/" in sub or http.upper() not in HTTP_VERBS:
            raise UnknownCall(f"{where}: DynamicClient.request {http} ...{suffix} is not in the mapping")
        verbs = _verb(http, _given(_kw(path, "name", 0)), _true(_kw(call, "watch")))
        receiver = path.func.value

        self._add(mod, call, self._resolve_grants(mod, call, self._on_handle(receiver, verbs, sub)))

    def _on_handle(self, receiver: ast.expr, verbs: list[str], sub: str = "") -> Callable[[Ctx], list[tuple[Grant, Assumptions]]]:
        """The grants of verbs on every resource handle the receiver may be (its subresource sub)."""
        def compute(ctx: Ctx) -> list[tuple[Grant, Assumptions]]:
            out = []
            for v in self.r.resolve(receiver, ctx):
                if not isinstance(v.value, Handle):
                    raise _Unresolved("not a resource")
                group, plural = plural_of(v.value.api_version, v.value.kind)
                out.extend(((group, f"{plural}/{sub}" if sub else plural, verb), v.assumes) for verb in verbs)
            return out
        return compute

    def _typed(self, mod: Module, func: ast.Attribute, call: ast.Call | None) -> None:
        name = self._typed_name(func.attr)
        assert name is not None
        where = f"{mod.rel}:{func.lineno}"
        if name.startswith("connect_"):
            raise UnknownCall(f"{where}: {name}: exec/attach/proxy verbs are not in the mapping")
        routes = typed_routes()[name]
        classes = _receiver_classes(func.value, mod)
        if classes:
            routes = [r for r in routes if r.cls in classes] or routes
        candidates = {(r.http, r.path) for r in routes}
        if len(candidates) > 1:
            raise UnknownCall(f"{where}: {name} exists in {sorted(r.cls for r in routes)}; construct the API class "
                              "where it is called so the mapping can tell which")
        route = routes[0]
        group, _version, rest = _split_path(route.path)
        plural_t, named = rest[0], len(rest) > 1 and rest[1] == "{name}"
        sub = "/".join(rest[2:]) if named else ""
        watch = call is None or _true(_kw(call, "watch"))  # passed to watch.stream, or watch=True
        verbs = _verb(route.http, named, watch)
        if call is None and route.http != "GET":
            raise UnknownCall(f"{where}: {name} passed as a value")
        placeholders = {"group": group, "plural": plural_t}
        if "{" not in group + plural_t:
            self._add(mod, call or func, [((group, f"{plural_t}/{sub}" if sub else plural_t, v), frozenset()) for v in verbs])
            return
        if call is None:
            raise UnknownCall(f"{where}: {name} passed as a value: its group and plural cannot be followed")
        api_cls = getattr(importlib.import_module("kubernetes.client"), route.cls)
        params = list(inspect.signature(getattr(api_cls, name)).parameters)[1:]
        exprs = {}
        for key in ("group", "plural"):
            if placeholders[key].startswith("{"):
                expr = _kw(call, key, params.index(key))
                if expr is None:
                    raise UnknownCall(f"{where}: {name} without {key}")
                exprs[key] = expr

        def compute(ctx: Ctx) -> list[tuple[Grant, Assumptions]]:
            keys = list(exprs)
            out = []
            for values, assumed in combine(*(self.r.resolve(exprs[k], ctx) for k in keys)):
                got = {**placeholders, **dict(zip(keys, values, strict=True))}
                resource = f"{got['plural']}/{sub}" if sub else got["plural"]
                out.extend(((got["group"], resource, v), assumed) for v in verbs)
            return out

        self._add(mod, call, self._resolve_grants(mod, call, compute))

    def _add(self, mod: Module, node: ast.AST, grants: list[tuple[Grant, Assumptions]], line: int | None = None) -> None:
        site = Site(mod.name, line or getattr(node, "lineno", 0), _qualname(mod, _enclosing_function(mod, node)))
        for grant, assumed in grants:
            through = tuple(sorted({o for k, o in assumed if isinstance(k, tuple) and k[1:] == ("site",)},
                                   key=lambda s: (s.module, s.line)))
            self.uses.append(Use(grant, site, through))


def _follow(expr: ast.expr, mod: Module) -> ast.expr:
    """A local name assigned once stands for what was assigned (path = res.path(...))."""
    if isinstance(expr, ast.Name):
        func = _enclosing_function(mod, expr)
        bound = _bindings(func).get(expr.id, []) if func is not None else []
        if len(bound) == 1 and bound[0][0] == "assign" and not bound[0][2]:
            return bound[0][1]
    return expr


def _receiver_classes(expr: ast.expr, mod: Module) -> set[str]:
    """The typed API class a receiver is built from, where the call site shows it."""
    if isinstance(expr, ast.Call):
        f = expr.func
        return {f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""}
    if isinstance(expr, ast.Name):
        func = _enclosing_function(mod, expr)
        scope = _bindings(func).get(expr.id, []) if func is not None else []
        return {c for kind, src, _ in scope if kind == "assign" for c in _receiver_classes(src, mod)}
    return set()


def code_uses() -> list[Use]:
    """Every grant the operator's own code needs, with where."""
    return Finder().run()


@contextlib.contextmanager
def analysing(overrides: dict[str, str]) -> Iterator[None]:
    """Analyse modules as if their source were the given text (to show what a new call does)."""
    def clear() -> None:
        for cached in (module, operator_modules, call_sites, referenced_as_value, reachable, _bindings, _code_uses):
            cached.cache_clear()

    _OVERRIDES.update(overrides)
    clear()
    try:
        yield
    finally:
        for name in overrides:
            _OVERRIDES.pop(name, None)
        clear()


def modules_calling_the_api() -> set[str]:
    """Modules outside the operator's import closure that call the API server (they must run as
    another identity, and say which in OTHER_IDENTITIES)."""
    out = set()
    kube_functions = set(module(KUBE).functions)
    for name in all_modules():
        if name in operator_modules() or name == KUBE:
            continue
        mod = module(name)
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Call):
                callee = _callee(mod, node.func)
                attr = node.func.attr if isinstance(node.func, ast.Attribute) else ""
                if (callee and callee[0] == KUBE and callee[1] in kube_functions - {"load_config", "secret_value"}) \
                        or Finder._typed_name(attr) or attr in ("server_side_apply", "call_api", "param_serialize"):
                    out.add(name)
    return out


# ---------------------------------------------------------------------------------------------
# kopf: what it does for the handlers kvpersist registers.


@dataclass(frozen=True)
class KopfNeed:
    grant: Grant
    why: str
    optional: bool = False  # kopf carries on without it (and logs a warning)


def kopf_settings(mode: str = "clusterwide") -> Any:
    """The settings kvpersist's startup handlers choose (its storages decide what kopf patches; in
    namespaced mode, as the chart runs it with watchNamespaces' names, whether kopf scans)."""
    import kopf

    from kvpersist.controller import kube, runtime

    importlib.import_module(ENTRY)  # registers the handlers
    settings = kopf.OperatorSettings()
    registry = kopf.get_default_registry()
    named = ("team-a",) if mode == "namespaced" else ()
    with mock.patch.object(kube, "load_config"), mock.patch.dict(runtime.CONTROLLER.peering, {"namespaces": named}):
        for handler in registry._activities.get_all_handlers():
            if str(handler.activity) in ("Activity.STARTUP", "startup") and not inspect.iscoroutinefunction(handler.fn) \
                    and "settings" in inspect.signature(handler.fn).parameters:
                handler.fn(settings=settings, logger=logging.getLogger("rbac_needs"))
    return settings


def kopf_needs(mode: str) -> list[KopfNeed]:
    import kopf
    from kopf._cogs.structs import references
    from kopf._core.intents import handlers as kopf_handlers

    importlib.import_module(ENTRY)  # registers the handlers
    registry = kopf.get_default_registry()
    settings = kopf_settings(mode)
    if registry._webhooks.get_all_handlers():
        raise UnknownCall("kopf admission webhooks are registered: the mapping does not know what they need")
    watched: dict[tuple[str, str], list[str]] = {}
    patched: dict[tuple[str, str], list[str]] = {}
    for reg, patches in ((registry._indexing, False), (registry._watching, False), (registry._changing, True),
                         (registry._spawning, True)):
        for handler in reg.get_all_handlers():
            selector = handler.selector
            if selector is None or not isinstance(handler, kopf_handlers.ResourceHandler):
                raise UnknownCall(f"kopf handler {handler.id} has no resource selector")
            resource = _selector_resource(selector)
            watched.setdefault(resource, []).append(handler.id)
            if patches:
                patched.setdefault(resource, []).append(handler.id)
    out: list[KopfNeed] = []
    for (group, plural), ids in sorted(watched.items()):
        why = "kopf: watch streams (initial listing, then events) for " + ", ".join(dict.fromkeys(ids))
        out += [KopfNeed((group, plural, "list"), why), KopfNeed((group, plural, "watch"), why)]
    storages = (settings.persistence.progress_storage, settings.persistence.diffbase_storage)
    in_status = any(not isinstance(s, kopf.AnnotationsProgressStorage | kopf.AnnotationsDiffBaseStorage) for s in storages)
    for (group, plural), ids in sorted(patched.items()):
        why = "kopf: progress and diff-base annotations (and finalizers) for " + ", ".join(dict.fromkeys(ids))
        out.append(KopfNeed((group, plural, "patch"), why))
        if in_status and has_status_subresource(group, plural):
            out.append(KopfNeed((group, f"{plural}/status", "patch"), "kopf: progress kept in status"))
    if settings.posting.enabled:
        level = logging.getLevelName(settings.posting.level)
        out.append(KopfNeed(("", "events", "create"), f"kopf: handler messages at level {level} and above posted as Events"))
    if not settings.scanning.disabled:
        crds = references.CRDS
        why = "kopf: notices CRDs added or changed after start (without it: the start-up scan only)"
        out += [KopfNeed((crds.group or "", crds.any_name or "", v), why, optional=True) for v in ("list", "watch")]
        if mode == "namespaced":
            ns = references.NAMESPACES
            why = "kopf: lists namespaces to match its namespace names (without it: assumes they exist)"
            out += [KopfNeed((ns.group or "", ns.any_name or "", v), why, optional=True) for v in ("list", "watch")]
    group, plural = peering_resource(mode)
    why = "kopf: peering between replicas (watch the record; keep-alive and leaving are patches)"
    out += [KopfNeed((group, plural, v), why) for v in ("list", "watch")]
    sub = f"{plural}/status" if has_status_subresource(group, plural) else plural
    out.append(KopfNeed((group, sub, "patch"), why))
    return out


def peering_resource(mode: str) -> tuple[str, str]:
    """kopf peers cluster-wide when it serves all namespaces, in each namespace otherwise (the
    chart always passes --peering); kvpersist.controller.runtime.active reads the same object."""
    from kopf._cogs.structs import references

    selector = references.CLUSTER_PEERINGS_K if mode == "clusterwide" else references.NAMESPACED_PEERINGS_K
    return selector.group or "", selector.plural or selector.any_name or ""


def _selector_resource(selector: Any) -> tuple[str, str]:
    group = selector.group or ""
    name = selector.plural or selector.any_name or selector.kind
    version = selector.version or ""
    if name is None:
        raise UnknownCall(f"kopf selector {selector} names no resource")
    plurals = {p for (g, v, k), p in kinds().items() if g == group and (not version or v == version)}
    if name in plurals:
        return group, name
    by_kind = {p for (g, v, k), p in kinds().items() if g == group and (not version or v == version) and k == name.lower()}
    if len(by_kind) == 1:
        return group, by_kind.pop()
    raise UnknownCall(f"kopf selector {selector}: no such resource")


# ---------------------------------------------------------------------------------------------
# The whole need, per mode.


@dataclass
class Needs:
    required: dict[Grant, list[str]]  # grant -> why (stable text, no line numbers)
    optional: dict[Grant, list[str]]  # kopf degrades without these
    sites: dict[Grant, list[str]]  # grant -> file:line of each call, for failure messages


@functools.cache
def _code_uses() -> tuple[Use, ...]:
    return tuple(code_uses())


def needs(mode: str) -> Needs:
    """What the operator's ServiceAccount needs in a mode of the chart."""
    assert mode in MODES
    other_peering = peering_resource("namespaced" if mode == "clusterwide" else "clusterwide")
    required: dict[Grant, list[str]] = {}
    sites: dict[Grant, list[str]] = {}
    for use in _code_uses():
        group, resource, _ = use.grant
        if (group, resource.split("/")[0]) == other_peering:
            continue  # runtime.active reads the peering object of the mode in use only
        why = f"`{use.where()}`"
        required.setdefault(use.grant, [])
        if why not in required[use.grant]:
            required[use.grant].append(why)
        outermost = max(use.through, key=lambda s: use.where().split(" ← ").index(s.function)
                        if s.function in use.where() else -1, default=use.call)
        sites.setdefault(use.grant, []).append(f"{module(outermost.module).rel}:{outermost.line}")
    optional: dict[Grant, list[str]] = {}
    for need in kopf_needs(mode):
        target = optional if need.optional and need.grant not in required else required
        target.setdefault(need.grant, [])
        if need.why not in target[need.grant]:
            target[need.grant].append(need.why)
    return Needs(required, optional, sites)


# ---------------------------------------------------------------------------------------------
# The chart's grants.


def helm_binary() -> Path | None:
    """helm from the local cluster's build, when built (`python3 hack/localcluster.py build`)."""
    out = subprocess.run([sys.executable, str(REPO / "hack" / "localcluster.py"), "bin-dir"], capture_output=True,
                         text=True, timeout=60)
    path = Path(out.stdout.strip()) / "helm"
    return path if out.returncode == 0 and path.exists() else None


def render(helm: Path, mode: str, release: str = "kvpersist", namespace: str = "kvpersist-system") -> list[dict[str, Any]]:
    args = [str(helm), "template", release, str(CHART), "--namespace", namespace]
    if mode == "namespaced":
        args += ["--set", "watchNamespaces={" + ",".join(WATCHED) + "}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"helm template: {out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _bound_rules(docs: list[dict[str, Any]], service_account: str, namespace: str) -> Iterator[tuple[str | None, str, dict]]:
    """(the namespace a binding grants in, None for a ClusterRoleBinding; the role's label; a rule)
    for every rule of every (Cluster)Role bound to the ServiceAccount."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs
             if d["kind"] in ("ClusterRole", "Role")}
    for binding in docs:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == service_account
                   and s.get("namespace", binding["metadata"].get("namespace")) == namespace
                   for s in binding.get("subjects") or []):
            continue
        ref = binding["roleRef"]
        where = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        role = roles.get((ref["kind"], where if ref["kind"] == "Role" else None, ref["name"]))
        if role is None:
            raise AssertionError(f"{binding['kind']} {binding['metadata']['name']} binds a {ref['kind']} {ref['name']} "
                                 "the chart does not render")
        label = f"{ref['kind']} {ref['name']}" + (f" in {where}" if where else "")
        for rule in role.get("rules") or []:
            yield where, label, rule


def _rule_grants(rule: dict[str, Any]) -> Iterator[Grant]:
    for group in rule.get("apiGroups") or []:
        for resource in rule.get("resources") or []:
            for verb in rule.get("verbs") or []:
                yield group, resource, verb


def chart_grants(docs: list[dict[str, Any]], service_account: str, namespace: str) -> dict[Grant, list[str]]:
    """grant -> the roles granting it, for every (Cluster)Role bound to the ServiceAccount."""
    out: dict[Grant, list[str]] = {}
    for _where, label, rule in _bound_rules(docs, service_account, namespace):
        for grant in _rule_grants(rule):
            out.setdefault(grant, []).append(label)
    return out


def scoped_grants(docs: list[dict[str, Any]], service_account: str, namespace: str) -> dict[str | None, dict[Grant, list[str]]]:
    """The ServiceAccount's grants by where they hold: None, everywhere (a ClusterRoleBinding);
    a namespace's name, there only (its RoleBindings)."""
    out: dict[str | None, dict[Grant, list[str]]] = {}
    for where, label, rule in _bound_rules(docs, service_account, namespace):
        for grant in _rule_grants(rule):
            out.setdefault(where, {}).setdefault(grant, []).append(label)
    return out


@functools.cache
def namespaced_resources() -> frozenset[tuple[str, str]]:
    """(group, plural) of every namespaced resource: the built-in ones from the typed client's
    paths (/namespaces/{namespace}/<plural>), the custom ones from the chart's CRDs' scope."""
    out = set()
    for routes in typed_routes().values():
        for route in routes:
            group, _version, rest = _split_path(route.path)
            if "/namespaces/{namespace}/" in route.path and rest and not rest[0].startswith("{"):
                out.add((group, rest[0]))
    out |= {(c["spec"]["group"], c["spec"]["names"]["plural"]) for c in _chart_crds() if c["spec"]["scope"] == "Namespaced"}
    return frozenset(out)


def is_namespaced(grant: Grant) -> bool:
    group, resource, _verb = grant
    return (group, resource.split("/")[0]) in namespaced_resources()


def cluster_scoped(need: Needs) -> set[Grant]:
    """What of a need can only be granted cluster-wide (a cluster-scoped resource), optional
    included, beyond what every authenticated user holds (DEFAULT_GRANTS)."""
    return {g for g in need.required.keys() | need.optional.keys() if not is_namespaced(g)} - DEFAULT_GRANTS


def scope_problems(need: Needs, docs: list[dict[str, Any]], service_account: str, namespace: str,
                   watched: tuple[str, ...]) -> list[str]:
    """Where the chart grants what: watching all namespaces (watched empty), everything
    cluster-wide; watching some, every namespaced grant in a Role of each of them and none
    cluster-wide or in another namespace, only cluster-scoped resources cluster-wide."""
    scoped = scoped_grants(docs, service_account, namespace)
    cluster = {**{g: ["every authenticated user"] for g in DEFAULT_GRANTS}, **scoped.get(None, {})}
    problems = []
    if watched:
        for grant in sorted(g for g in cluster if is_namespaced(g)):
            problems.append(f"cluster-wide grant {_fmt(grant)} ({', '.join(cluster[grant])}): a namespaced resource, "
                            "which with watchNamespaces belongs in the Role of each watched namespace only")
    for where in sorted(w for w in scoped if w is not None and w not in watched):
        problems.append(f"grants in namespace {where}, which is not watched: "
                        + ", ".join(_fmt(g) for g in sorted(scoped[where])))
    for where in watched or (None,):
        have = cluster.keys() | scoped.get(where, {}).keys()
        for grant in sorted(g for g in need.required.keys() - have if is_namespaced(g)):
            problems.append(f"missing grant {_fmt(grant)} in {'every namespace' if where is None else where}")
    for grant in sorted(g for g in need.required.keys() - cluster.keys() if not is_namespaced(g)):
        problems.append(f"missing cluster-wide grant {_fmt(grant)} (a cluster-scoped resource: only a ClusterRole grants it)")
    for where, grants in scoped.items():
        for grant in sorted(g for g in grants if where is not None and not is_namespaced(g)):
            problems.append(f"grant {_fmt(grant)} in a Role of {where}: a cluster-scoped resource, which no Role reaches")
    return problems


def compare(need: Needs, granted: dict[Grant, list[str]]) -> list[str]:
    """What is needed and not granted, and what is granted and not needed (wildcards included)."""
    problems = []
    for grant in sorted(need.required.keys() - granted.keys() - DEFAULT_GRANTS):
        problems.append(f"missing grant {_fmt(grant)}: needed by {'; '.join(need.required[grant])} "
                        f"({', '.join(need.sites.get(grant, ['kopf']))})")
    for grant in sorted(granted.keys() - need.required.keys() - need.optional.keys()):
        problems.append(f"unused grant {_fmt(grant)} ({', '.join(granted[grant])}): no code or kopf handler needs it")
    return problems


def _fmt(grant: Grant) -> str:
    group, resource, verb = grant
    return f"{verb} {resource}{'.' + group if group else ''}"


def can_i_pairs(grants: set[Grant]) -> set[tuple[str, str]]:
    """As `kubectl auth can-i --list` prints them: (resource[.group][/sub], verb)."""
    out = set()
    for group, resource, verb in grants:
        base, _, sub = resource.partition("/")
        out.add(((f"{base}.{group}" if group else base) + (f"/{sub}" if sub else ""), verb))
    return out


# ---------------------------------------------------------------------------------------------
# docs/security.md's table.

TABLE_BEGIN = "<!-- rbac-table: generated by `python -m tests.rbac_needs --write-docs`; tests/unit/test_rbac.py checks it -->"
TABLE_END = "<!-- rbac-table end -->"


def docs_table() -> str:
    """One row per (group, resource) and mode: its verbs and what needs each."""
    rows = ["| apiGroup | resource | verbs | mode | needed by |", "| --- | --- | --- | --- | --- |"]
    per_mode = {m: needs(m) for m in MODES}
    keys = sorted({(g, r) for n in per_mode.values() for (g, r, _v) in n.required.keys() | n.optional.keys()})
    for group, resource in keys:
        lines: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
        for mode, need in per_mode.items():
            verbs = sorted(v for (g, r, v) in need.required if (g, r) == (group, resource))
            opt = sorted(v for (g, r, v) in need.optional if (g, r) == (group, resource))
            why = [f"{v}: {'; '.join(need.required[(group, resource, v)])}"
                   + (" (every authenticated user's, by Kubernetes' system:basic-user: not in the chart)"
                      if (group, resource, v) in DEFAULT_GRANTS else "") for v in verbs]
            why += [f"{v} (optional, not required): {'; '.join(need.optional[(group, resource, v)])}" for v in opt]
            verbs_text = ", ".join(verbs + [f"({v})" for v in opt])
            if not verbs_text:
                continue  # not needed in this mode (the other mode's peering kind)
            lines.setdefault((verbs_text, "<br>".join(why)), ([], []))[0].append(mode)
        for (verbs_text, why), (modes, _) in lines.items():
            mode_text = "both" if len(modes) == len(MODES) else modes[0]
            rows.append(f"| `{group or 'core'}` | `{resource}` | {verbs_text} | {mode_text} | {why} |")
    return "\n".join(rows)


def docs_block() -> str:
    return f"{TABLE_BEGIN}\n{docs_table()}\n{TABLE_END}"


def write_docs() -> bool:
    text = DOCS.read_text()
    start, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if start < 0 or end < 0:
        raise SystemExit(f"{DOCS}: no table markers")
    new = text[:start] + docs_block() + text[end + len(TABLE_END):]
    DOCS.write_text(new)
    return new != text


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        print(f"{DOCS}: {'rewritten' if write_docs() else 'unchanged'}")
    else:
        for m in MODES:
            n = needs(m)
            print(f"# {m}")
            for g in sorted(n.required):
                print("  ", _fmt(g), "<-", "; ".join(n.required[g]))
            for g in sorted(n.optional):
                print("  (optional)", _fmt(g), "<-", "; ".join(n.optional[g]))
