"""Attach mode's admission policies (docs/attach.md): static, run by the API server with the resource as param,
reading its status.attach (no webhook: judged while the operator is down, and the operator needs no right on admission objects).
The mutation only adds what is absent; the validation, after every mutation, requires the exact values, so a
differing value is refused naming the field, never overwritten."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpersist.api import policyfiles
from kvpersist.api.identity import NAMESPACE_ID_LABEL
from kvpersist.api.policyfiles import CEL, admission, cel_literal, chart_doc, dump, var
from kvpersist.api.spec import EXTRA_ARG_REGEX, EXTRA_ARG_VALUE_FLAGS, env_name_rule
from kvpersist.api.v1alpha1 import API_VERSION, KIND
from kvpersist.api.vllmpod import POD_AFFINITY, REQUIRED, SHM_PATH, beside_servers, server_term, shm_mount, shm_volume

POLICY = "attach"  # kvpersist-attach; the chart's: <fullname>-attach
PLAIN_NAME = f"kvpersist-{POLICY}"
CONFIG_PATH = Path("config/attach/attach.yaml")
TEMPLATE_PATH = Path("charts/kvpersist/templates/attach.yaml")
VALUE = "attach"
LABEL = "kvpersist.dev/attach"  # on a user's pod: the KVCacheNamespace (same namespace) it attaches to
CONTAINER_ANNOTATION = "kvpersist.dev/attach-container"
DEFAULT_CONTAINER = "vllm"
SHM_VOLUME = "kvpersist-dshm"
MAX_ARGS = 128  # CEL walks a list by index: an attached container's args are at most this long
# Flags an attached pod sets for itself, as the operator does on its own pods (where it listens, the name clients
# use, its API key): none changes the KV.
ATTACH_OWN_FLAGS = ("--api-key", "--host", "--port", "--served-model-name")
# Refused in spec.vllm.env only because they have a field of their own there (a Secret reference)
# or the operator sets them on its own pods (HOME: KServe sets its own): an attached pod's own business.
ATTACH_OWN_ENV = ("HF_TOKEN", "HOME", "HUGGING_FACE_HUB_TOKEN", "VLLM_API_KEY")
# huggingface_hub serves a 40-hex revision from its cache unchecked, so a seeded cache is other weights under the
# pin: allowed only at an emptyDir no other container mounts (KServe's /models, llm-d's /model-cache).
CACHE_ENV = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")
EPHEMERAL = "ephemeralcontainers"  # pods/ephemeralcontainers (kubectl debug): refused on attached pods


def _common_variables() -> list[dict[str, str]]:
    """What both policies read: whether the param is the resource the pod's label names, whether it
    takes attached pods (mode Attached, status.attach written), and the vLLM container's name."""
    annotations = "object.metadata.annotations"
    return [
        var("mine", f"has(object.metadata.labels) && '{LABEL}' in object.metadata.labels",
            f"&& object.metadata.labels['{LABEL}'] == params.metadata.name"),
        var("attached", "has(params.spec.vllm) && has(params.spec.vllm.mode) && params.spec.vllm.mode == 'Attached'"),
        var("ready", "variables.attached && has(params.status) && has(params.status.attach)"),
        # The cache off for vLLM (status.attach.bypassed): no connection added, none required.
        var("bypassed", "variables.ready && has(params.status.attach.bypassed)"),
        var("cname", f"has({annotations}) && '{CONTAINER_ANNOTATION}' in {annotations}",
            f"? {annotations}['{CONTAINER_ANNOTATION}'] : '{DEFAULT_CONTAINER}'"),
    ]


def _validating_variables() -> list[dict[str, str]]:
    own = ", ".join(f"'{f}'" for f in ATTACH_OWN_FLAGS)
    args, count, attach = "variables.args", "variables.count", "params.status.attach"
    return [
        *_common_variables(),
        var("judged", "variables.mine && variables.ready"),
        var("cs", "object.spec.containers.filter(c, c.name == variables.cname)"),
        var("found", "size(variables.cs) == 1"),
        var("command", "variables.found && has(variables.cs[0].command) ? variables.cs[0].command : []"),
        # `vllm serve` as the command (llm-d's modelservice writes it so) reads as `vllm` with serve first.
        var("args", "(variables.command == ['vllm', 'serve'] ? ['serve'] : [])",
            "+ (variables.found && has(variables.cs[0].args) ? variables.cs[0].args : [])"),
        var("count", "size(variables.args)"),
        var("idx", str(list(range(MAX_ARGS)))),
        # The pins and the connection flags: each exactly once, `flag value`, at the status' value.
        var("wanted", f"!variables.ready ? [] : {attach}.pins.map(p, [string(p.flag), string(p.value), string(p.field)])",
            f"+ [0, 2, 4, 6].filter(k, !variables.bypassed && k + 1 < size({attach}.args))",
            f"  .map(k, [string({attach}.args[k]), string({attach}.args[k + 1]), 'status.attach.args'])"),
        var("wrongPins", "variables.wanted.filter(w,",
            f"variables.idx.filter(i, i < {count} && ({args}[i] == w[0] || {args}[i].startsWith(w[0] + '='))).size() != 1",
            f"|| !variables.idx.exists(i, i + 1 < {count} && {args}[i] == w[0] && {args}[i + 1] == w[1]))"),
        var("known", f"variables.wanted.map(w, w[0]) + [{own}]"),
        var("valueFlags", f"variables.known + {EXTRA_ARG_VALUE_FLAGS}"),
        # extraArgs' allow-list rule, over the arguments after `serve MODEL`, with the known flags.
        var("refusedFlags", f"variables.idx.filter(i, i >= 2 && i < {count} && {args}[i].startsWith('-')",
            f"&& !{args}[i].matches('{EXTRA_ARG_REGEX}')",
            f"&& !({args}[i] in variables.known))",
            f".map(i, {args}[i])"),
        # extraArgs' values rule: a word is the value of the flag before it, and such a flag has one.
        var("strayWords", f"variables.idx.filter(i, i >= 2 && i < {count} && ({args}[i].startsWith('-')",
            f"? ({args}[i] in variables.valueFlags && !(i + 1 < {count} && !{args}[i + 1].startsWith('-')))",
            f": !(i > 2 && {args}[i - 1] in variables.valueFlags)))",
            f".map(i, {args}[i])"),
        # The other containers, init containers (native sidecars) included: each runs an image of spec.vllm.attachedContainers.
        var("others", "object.spec.containers.filter(c, c.name != variables.cname)",
            "+ (has(object.spec.initContainers) ? object.spec.initContainers : [])"),
        var("refusedContainers", "variables.others.filter(c, !(has(params.spec.vllm.attachedContainers)",
            "&& c.image in params.spec.vllm.attachedContainers)).map(c, c.name + ' (' + c.image + ')')"),
        var("freshDirs", "!variables.found || !has(variables.cs[0].volumeMounts) || !has(object.spec.volumes) ? []",
            ": variables.cs[0].volumeMounts.filter(m, (!has(m.subPath) || m.subPath == '')",
            "  && object.spec.volumes.exists(v, v.name == m.name && has(v.emptyDir))",
            "  && !variables.others.exists(c, has(c.volumeMounts) && c.volumeMounts.exists(o, o.name == m.name)))",
            "  .map(m, m.mountPath)"),
        var("env", "variables.found && has(variables.cs[0].env) ? variables.cs[0].env : []"),
        # Each at its value, or from its downward API field (the pod IP of llm-d's event topic).
        var("wrongEnv", "!variables.ready || variables.bypassed ? [] : params.status.attach.env.filter(e,",
            "variables.env.filter(x, x.name == e.name).size() != 1",
            "|| !variables.env.exists(x, x.name == e.name && (has(e.fieldPath)",
            "  ? has(x.valueFrom) && has(x.valueFrom.fieldRef) && x.valueFrom.fieldRef.fieldPath == e.fieldPath",
            "  : has(x.value) && x.value == e.value)))",
            ".map(e, e.name + (has(e.fieldPath) ? ' from ' + e.fieldPath : '=' + e.value))"),
        var("refusedEnv", "!variables.ready ? [] : variables.env.filter(x,",
            "!params.status.attach.env.exists(e, e.name == x.name)",
            f"&& !({env_name_rule('x.name', ATTACH_OWN_ENV)})",
            f"&& !(x.name in [{', '.join(repr(n) for n in CACHE_ENV)}] && has(x.value) && x.value in variables.freshDirs))",
            ".map(x, x.name)"),
    ]


def _check(expression: str, message: str) -> dict[str, str]:
    """A validation of the pod for the resource its label names; other params pass it."""
    return {"expression": f"!variables.judged || ({expression})", "messageExpression": message}


def _container(field: str) -> str:
    return f"'spec.containers[' + variables.cname + '].{field}"


def _validations() -> list[dict[str, str]]:
    who = "'KVCacheNamespace ' + params.metadata.name"
    labels = "object.metadata.labels"
    return [
        # Judged for every param, first: a debug container shares the pod's network and runs what no pin covers.
        {"expression": f"!has(request.subResource) || request.subResource != '{EPHEMERAL}'", "messageExpression":
         f"'ephemeral containers are refused on a pod labelled {LABEL}: they share its network, a peer of the lmcache "
         "servers, and run what no pin covers; debug a copy of the pod without the label (kubectl debug --copy-to)'"},
        # The id label is the policy's: a pod that wears this resource's id names this resource.
        {"expression": f"variables.mine || !variables.ready || !('{NAMESPACE_ID_LABEL}' in {labels}) "
                       f"|| {labels}['{NAMESPACE_ID_LABEL}'] != params.status.attach.namespaceId",
         "messageExpression": f"'metadata.labels[{NAMESPACE_ID_LABEL}] ' + params.status.attach.namespaceId + ' is the "
         f"namespace id of ' + {who} + ', but label {LABEL} names ' + {labels}['{LABEL}'] + ': the id label is the "
         "policy\\'s to set; remove it'"},
        {"expression": "!variables.mine || variables.attached", "messageExpression":
         f"{who} + ' runs its own vLLM (spec.vllm.mode Managed): label kvpersist.dev/attach only pods for a "
         "resource with spec.vllm.mode Attached'"},
        {"expression": "!variables.mine || !variables.attached || variables.ready", "messageExpression":
         f"{who} + ' has no namespace id to attach to (status.attach is empty): a pin is missing or refused, its "
         "image has no digest, or the operator has not reconciled it yet; kubectl describe kvcachenamespace ' "
         "+ params.metadata.name + ' says which'"},
        _check("variables.found", f"'no container named ' + variables.cname + ' (annotate the pod with "
               f"{CONTAINER_ANNOTATION}=<the vLLM container> when it has another name)'"),
        _check("!variables.found || variables.command in [['vllm'], ['vllm', 'serve']]",
               _container("command") + " must be [\"vllm\"], with args [\"serve\", MODEL, ...], or [\"vllm\", \"serve\"] "
               "with args [MODEL, ...]: a shell or another launcher would run arguments the API server cannot check "
               "against ' + " + who + " + '\\'s pins'"),
        _check("!variables.found || !has(variables.cs[0].lifecycle)",
               _container("lifecycle") + " is refused: its hooks run commands in the vLLM container that no pin covers'"),
        _check("size(variables.refusedContainers) == 0",
               "'containers other than ' + variables.cname + ': ' + variables.refusedContainers.join(', ') + ' refused: "
               f"they share the pod\\'s network, a peer of the lmcache servers; list their images, by digest, in "
               f"spec.vllm.attachedContainers of ' + {who}"),
        _check(f"variables.count <= {MAX_ARGS}", _container("args") + f": at most {MAX_ARGS} items'"),
        _check("variables.count >= 2 && variables.args[0] == 'serve' && variables.args[1] == params.status.attach.model",
               _container("args") + " must start with serve ' + params.status.attach.model + ' (spec.identity.modelId of ' "
               f"+ {who} + '), a model id, never a path'"),
        _check("!variables.found || variables.cs[0].image.trim().endsWith('@' + params.status.attach.imageDigest)",
               _container("image") + " must be pinned by digest to ' + params.status.attach.imageDigest + ', the "
               f"digest of spec.image of ' + {who}"),
        _check("size(variables.wrongPins) == 0",
               _container("args") + " must carry each pin once as `flag value`: ' + variables.wrongPins.map(w, w[0] + ' ' "
               f"+ w[1] + ' (' + w[2] + ')').join(', ') + ' of ' + {who}"),
        _check("size(variables.refusedFlags) == 0",
               _container("args") + ": ' + variables.refusedFlags.join(', ') + ' refused: besides the pins, only the "
               "flags spec.vllm.extraArgs allows (docs/api.md), ' + variables.known.join(', ') + ', spelled in full'"),
        _check("size(variables.strayWords) == 0",
               _container("args") + ": ' + variables.strayWords.join(', ') + ': a word must be the value of the flag "
               "before it, and a flag that takes a value must have one; another word would reach vLLM as a positional "
               "argument'"),
        _check("size(variables.wrongEnv) == 0",
               _container("env") + " must set ' + variables.wrongEnv.join(', ') + ' exactly once, by value (the prefix "
               "hashes and the KV process ' + " + who + " + ' serves need them; the policy adds them when absent)'"),
        _check("size(variables.refusedEnv) == 0",
               _container("env") + ": ' + variables.refusedEnv.join(', ') + ' refused: they change the KV, the model "
               "behind the pins or the code that runs (docs/api.md, env)'"),
        _check("!variables.found || !has(variables.cs[0].envFrom) || size(variables.cs[0].envFrom) == 0",
               _container("envFrom") + " is refused: its keys are unknown at admission; list the variables in env "
               "(valueFrom for a Secret)'"),
        _check(f"'{NAMESPACE_ID_LABEL}' in object.metadata.labels && object.metadata.labels['{NAMESPACE_ID_LABEL}'] "
               "== params.status.attach.namespaceId",
               f"'metadata.labels[{NAMESPACE_ID_LABEL}] must be ' + params.status.attach.namespaceId + ', the namespace id "
               f"of ' + {who} + ' (the policy adds it when absent)'"),
        # Judged for every param, last (the API server names the first refusal): a label naming no resource got nothing.
        {"expression": f"'{NAMESPACE_ID_LABEL}' in object.metadata.labels", "messageExpression":
         f"'no KVCacheNamespace named ' + object.metadata.labels['{LABEL}'] + ' with spec.vllm.mode Attached "
         f"and a namespace id in namespace ' + object.metadata.namespace + ' (label {LABEL})'"},
    ]


def _policy(kind: str, name: str, operations: list[str], resources: tuple[str, ...] = ("pods",), **spec: Any) -> dict[str, Any]:
    """An admission policy on pods whose param is the KVCacheNamespace; an error refuses (Fail):
    never a pod attached unchecked."""
    rules = [{"apiGroups": [""], "apiVersions": ["v1"], "operations": operations, "resources": list(resources)}]
    param = {"apiVersion": API_VERSION, "kind": KIND}
    return admission(kind, name, {"failurePolicy": "Fail", "paramKind": param, "matchConstraints": {"resourceRules": rules}, **spec})


def validating_policy(name: str) -> dict[str, Any]:
    # An UPDATE of a labelled pod's labels or spec is judged (what it runs, for its whole life); other metadata
    # (annotations, owners, finalizers) is left to the controllers that write it.
    conditions = [
        {"name": "labelled", "expression": f"has(object.metadata.labels) && '{LABEL}' in object.metadata.labels"},
        {"name": "changed", "expression": "request.operation == 'CREATE' || !has(oldObject.metadata.labels) "
                                          "|| oldObject.metadata.labels != object.metadata.labels || oldObject.spec != object.spec"},
    ]
    return _policy("ValidatingAdmissionPolicy", name, ["CREATE", "UPDATE"], ("pods", f"pods/{EPHEMERAL}"),
                   matchConditions=conditions, variables=_validating_variables(), validations=_validations())


def _mutating_variables() -> list[dict[str, str]]:
    return [
        *_common_variables(),
        var("i", "object.spec.containers.map(c, c.name).indexOf(variables.cname)"),
        var("labels", "variables.mine && variables.ready && variables.i >= 0"),
        var("go", "variables.labels && !variables.bypassed"),
        var("c", "variables.go ? object.spec.containers[variables.i] : object.spec.containers[0]"),
        var("path", "'/spec/containers/' + string(variables.i)"),
        var("term", cel_literal(server_term(CEL("params.status.attach.serverSelector")))),
    ]


def _mutation() -> str:
    """One JSONPatch: each addition only where the pod has nothing of its own."""
    label = (f"!has(object.metadata.labels) ? [JSONPatch{{op: 'add', path: '/metadata/labels', value: "
             f"{{'{NAMESPACE_ID_LABEL}': params.status.attach.namespaceId}}}}]\n"
             f"  : '{NAMESPACE_ID_LABEL}' in object.metadata.labels ? []\n"
             f"  : [JSONPatch{{op: 'add', path: '/metadata/labels/{NAMESPACE_ID_LABEL.replace('/', '~1')}', "
             "value: params.status.attach.namespaceId}]")
    # The flag and value pairs whose flag the args lack, appended (the validation refuses a container without args).
    args = ("!has(variables.c.args) ? [] : [0, 1, 2, 3, 4, 5, 6, 7].filter(k, k < size(params.status.attach.args)\n"
            "    && !(params.status.attach.args[k - k % 2] in variables.c.args)\n"
            "    && !variables.c.args.exists(a, a.startsWith(params.status.attach.args[k - k % 2] + '=')))\n"
            "  .map(k, JSONPatch{op: 'add', path: variables.path + '/args/-', value: params.status.attach.args[k]})")
    # A status.attach.env entry as a container's variable: its value, or its downward API field.
    env_var = ("(has(e.fieldPath) ? {'name': dyn(e.name), 'valueFrom': dyn({'fieldRef': {'apiVersion': dyn('v1'), "
           "'fieldPath': dyn(e.fieldPath)}})} : {'name': dyn(e.name), 'value': dyn(e.value)})")
    env = ("!has(variables.c.env) ? [JSONPatch{op: 'add', path: variables.path + '/env', "
           f"value: params.status.attach.env.map(e, {env_var})}}]\n"
           "  : params.status.attach.env.filter(e, !variables.c.env.exists(x, x.name == e.name))\n"
           f"    .map(e, JSONPatch{{op: 'add', path: variables.path + '/env/-', value: {env_var}}})")
    volume, mount = cel_literal(shm_volume(SHM_VOLUME)), cel_literal(shm_mount(SHM_VOLUME))
    shm = (f"has(variables.c.volumeMounts) && variables.c.volumeMounts.exists(m, m.mountPath == '{SHM_PATH}') ? []\n"
           f"  : (has(object.spec.volumes) ? [JSONPatch{{op: 'add', path: '/spec/volumes/-', value: {volume}}}]\n"
           f"    : [JSONPatch{{op: 'add', path: '/spec/volumes', value: [{volume}]}}])\n"
           f"  + (has(variables.c.volumeMounts) ? [JSONPatch{{op: 'add', path: variables.path + '/volumeMounts/-', value: {mount}}}]\n"
           f"    : [JSONPatch{{op: 'add', path: variables.path + '/volumeMounts', value: [{mount}]}}])")
    beside = beside_servers(CEL("variables.term"))
    pod, required = f"object.spec.affinity.{POD_AFFINITY}", f"/spec/affinity/{POD_AFFINITY}/{REQUIRED}"
    affinity = (f"!has(object.spec.affinity) ? [JSONPatch{{op: 'add', path: '/spec/affinity', value: {cel_literal(beside)}}}]\n"
                f"  : !has({pod}) ? [JSONPatch{{op: 'add', path: '/spec/affinity/{POD_AFFINITY}', "
                f"value: {cel_literal(beside[POD_AFFINITY])}}}]\n"
                f"  : !has({pod}.{REQUIRED}) ? [JSONPatch{{op: 'add', "
                f"path: '{required}', value: [variables.term]}}]\n"
                f"  : {pod}.{REQUIRED}.exists(t, t == variables.term) ? []\n"
                f"  : [JSONPatch{{op: 'add', path: '{required}/-', value: variables.term}}]")
    connection = [args, env, shm, affinity]
    return (f"(!variables.labels ? [] : ({label}))\n+ (!variables.go ? [] :\n"
            + "\n+ ".join(f"({p})" for p in connection) + ")")


def mutating_policy(name: str) -> dict[str, Any]:
    return _policy("MutatingAdmissionPolicy", name, ["CREATE"], reinvocationPolicy="Never", variables=_mutating_variables(),
                   mutations=[{"patchType": "JSONPatch", "jsonPatch": {"expression": _mutation()}}])


def bindings(name: str) -> list[dict[str, Any]]:
    # The param: every KVCacheNamespace of the pod's namespace (each judges only pods labelled with its name); none: refused.
    spec = {"policyName": name, "paramRef": {"selector": {}, "parameterNotFoundAction": "Deny"},
            "matchResources": {"objectSelector": {"matchExpressions": [{"key": LABEL, "operator": "Exists"}]}}}
    return [admission("MutatingAdmissionPolicyBinding", name, spec),
            admission("ValidatingAdmissionPolicyBinding", name, {**spec, "validationActions": ["Deny"]})]


def documents(name: str) -> list[dict[str, Any]]:
    return [mutating_policy(name), validating_policy(name), *bindings(name)]


HEADER = f"""\
# Generated by `kvpersist-operator attach-policy --write` from kvpersist.api.attachpolicy. Do not edit.
# Attach mode (docs/attach.md): a pod labelled {LABEL}=<KVCacheNamespace> (spec.vllm.mode Attached)
# gets the connection settings the resource's status.attach lists, where it has none of its own, and is
# admitted only when its vLLM container carries exactly the resource's pins. Needs Kubernetes >= 1.36
# (MutatingAdmissionPolicy v1). The Helm chart ships the same objects
# ({TEMPLATE_PATH.relative_to("charts/kvpersist")}, attach.enabled).
#   kubectl apply -f {CONFIG_PATH}
"""

CHART_HEADER = f"""\
# Generated by `kvpersist-operator attach-policy --write` from kvpersist.api.attachpolicy. Do not edit.
# Attach mode (docs/attach.md): the same objects as {CONFIG_PATH} for kubectl users.
"""


def render_config() -> str:
    return HEADER + "---\n".join(dump(d) for d in documents(PLAIN_NAME))


# Only where the API server serves MutatingAdmissionPolicy v1 (Kubernetes >= 1.36): elsewhere the
# chart installs without attach mode, and a resource with spec.vllm.mode Attached says so (docs/attach.md).
SERVED = '(.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")'


# In namespaced mode (watchNamespaces) the bindings match pods of those namespaces only, where the
# operator writes status.attach (beside the label selector: one matchResources).
NAMESPACE_SCOPE = ("{{- with .Values.watchNamespaces }}\n"
                   "    namespaceSelector:\n      matchExpressions:\n"
                   "        - {key: kubernetes.io/metadata.name, operator: In, values: {{ toJson . }}}\n"
                   "{{- end }}\n")
OBJECT_SELECTOR = "        operator: Exists\n"  # the bindings' objectSelector: no policy has such a line


def render_template() -> str:
    docs = [chart_doc(d, POLICY).replace(OBJECT_SELECTOR, OBJECT_SELECTOR + NAMESPACE_SCOPE, 1)
            for d in documents(PLAIN_NAME)]
    return (CHART_HEADER + f"{{{{- if and .Values.{VALUE}.enabled {SERVED} }}}}\n" + "---\n".join(docs)
            + "{{- end }}\n")


def write(root: Path) -> list[Path]:
    return policyfiles.write(root, ((CONFIG_PATH, render_config()), (TEMPLATE_PATH, render_template())))

