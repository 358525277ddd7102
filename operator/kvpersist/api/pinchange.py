"""The pin-change warning, generated from id_fields: a change that moves the namespace id orphans the old KV, which
should be seen at `kubectl apply` (Warn only, never a refusal). CEL cannot compute the new id (no sha256, the key is
a Secret's): `kvpersist plan -f` does. A key rotated in the same Secret is not seen here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpersist.api import policyfiles
from kvpersist.api.identity import ADAPTER_FIELD, IdField, id_fields
from kvpersist.api.policyfiles import admission, chart_doc, dump, var
from kvpersist.api.v1alpha1 import GROUP, PLURAL

POLICY = "pin-change-warning"  # kvpersist-pin-change-warning; the chart's: <fullname>-pin-change-warning
PLAIN_NAME = f"kvpersist-{POLICY}"
CONFIG_PATH = Path("config/pin-change-warning/pin-change-warning.yaml")
TEMPLATE_PATH = Path("charts/kvpersist/templates/pin-change-warning.yaml")
VALUE = "pinChangeWarning"
KEY_PREFIX = "spec.l2.encryption.keySecretRef."
# The image digest as identity.image_digest takes it: @sha256:<64 hex> at the end of the trimmed reference.
DIGEST_RE = "@sha256:[0-9a-f]{64}$"
UNITS = (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))  # as status.usage.human_bytes


def _has(path: str, root: str = "oldObject") -> str:
    """CEL: every has() down root.path (root itself taken as present)."""
    parts = path.split(".")
    return " && ".join(f"has({root}.{'.'.join(parts[:i + 1])})" for i in range(len(parts)))


def field_value(obj: str, field: IdField) -> str:
    """CEL: the field of obj (object or oldObject) as the id sees it, a string ('' when unset or an image without a digest)."""
    guards = _has(field.path.removeprefix("spec."), f"{obj}.spec")
    value = f"string({obj}.{field.path})"
    if field.kind == "fs_native":
        guards += f" && {obj}.spec.l2.nvme.adapter == 'fs_native'"
    if field.kind == "digest":
        value += f".trim().find('{DIGEST_RE}')"
    return f"({guards} ? {value} : '')"


def changed_expression() -> str:
    """CEL: the list of id_fields paths whose value differs between oldObject and object."""
    same_adapter = f"{field_value('oldObject', ADAPTER_FIELD)} == {field_value('object', ADAPTER_FIELD)}"
    items = ",\n".join(f"  {field_value('oldObject', f)}\n    != {field_value('object', f)}"
                       + (f" && {same_adapter}" if f.kind == "fs_native" else "") + f" ? '{f.path}' : ''" for f in id_fields())
    return f"[\n{items}\n].filter(p, p != '')"


def _human_bytes() -> list[dict[str, str]]:
    """Variables that write variables.bytes as status.usage.human_bytes does (12.3Gi, 512B): one
    decimal rounded half to even, as Python formats the exact quotient, and a trailing .0 dropped."""
    unit = " : ".join(f"variables.bytes >= {size} ? {size}" for _, size in UNITS) + " : 1"
    names = ", ".join(f"{size}: '{name}'" for name, size in UNITS)
    return [
        var("unit", unit),
        var("quotient", "variables.bytes * 10 / variables.unit"),
        var("remainder", "variables.bytes * 10 % variables.unit"),
        var("tenths", "variables.quotient + (2 * variables.remainder > variables.unit",
            "|| (2 * variables.remainder == variables.unit && variables.quotient % 2 == 1) ? 1 : 0)"),
        var("size", "variables.unit == 1 ? string(variables.bytes) + 'B'",
            ": string(variables.tenths / 10) + (variables.tenths % 10 == 0 ? '' : '.' + string(variables.tenths % 10))",
            f"+ {{{names}}}[variables.unit]"),
    ]


MESSAGE = ("identity changes: this resource will serve another namespace id, and the cached KV of the one it serves now "
           "will no longer be served; it stays in L2 as an orphan until `kvpersist gc`; `kubectl kvpersist plan -f FILE` "
           "shows both ids and what each holds")


def policy(name: str) -> dict[str, Any]:
    variables = [
        var("served", f"{_has('status.namespaceId')} ? oldObject.status.namespaceId : ''"),
        var("changed", changed_expression()),
        var("keyOnly", f"variables.changed.all(p, p.startsWith('{KEY_PREFIX}'))"),
        var("measured", _has("status.usage.measuredAt")),
        var("bytes", f"variables.measured && {_has('status.usage.l2UsedBytes')}", "? oldObject.status.usage.l2UsedBytes : 0"),
        var("objects", f"variables.measured && {_has('status.usage.l2Objects')}", "? oldObject.status.usage.l2Objects : 0"),
        *_human_bytes(),
        var("hits", f"{_has('status.hits.summary')} ? ', hit rate ' + oldObject.status.hits.summary : ''"),
        var("held", "(variables.measured ? variables.size + ' in ' + string(variables.objects) + ' objects'",
            ": 'its size not measured yet') + variables.hits"),
    ]
    message = ("'identity changes (' + variables.changed.join(', ') + '): ' + variables.served + ' (' + variables.held + ')'\n"
               "+ (variables.keyOnly ? ' will no longer be served unless the new Secret holds the same key'"
               " : ' will no longer be served')\n"
               "+ '; it stays in L2 as an orphan until `kvpersist gc ' + variables.served + '`'\n"
               "+ '; `kubectl kvpersist plan -f FILE` shows the new id and whether it already has data'")
    return admission("ValidatingAdmissionPolicy", name, {
        "failurePolicy": "Ignore",
        "matchConstraints": {"resourceRules": [{"apiGroups": [GROUP], "apiVersions": ["*"], "operations": ["UPDATE"],
                                                "resources": [PLURAL]}]},
        "variables": variables,
        "validations": [{"expression": "size(variables.changed) == 0 || variables.served == ''",
                         "message": MESSAGE, "messageExpression": message}],
    })


def binding(name: str) -> dict[str, Any]:
    return admission("ValidatingAdmissionPolicyBinding", name, {"policyName": name, "validationActions": ["Warn"]})


HEADER = f"""\
# Generated by `kvpersist-operator pin-change-policy --write` from kvpersist.api.identity.id_fields. Do not edit.
# A Warning at `kubectl apply` when a change moves the namespace id (docs/api.md, "Before a pin
# change"): the fields that reach the id ({", ".join(f.path for f in id_fields())})
# are compared between the stored object and the new one; when one differs and the resource serves
# a namespace, kubectl prints the fields, the id, what it holds and its hit rate. Warn only (a
# change is never refused here). `kubectl kvpersist plan -f FILE` computes the new id. The Helm
# chart ships the same objects ({TEMPLATE_PATH.relative_to("charts/kvpersist")}, pinChangeWarning.enabled).
# Needs Kubernetes >= 1.30 (ValidatingAdmissionPolicy v1).
#   kubectl apply -f {CONFIG_PATH}
"""

CHART_HEADER = f"""\
# Generated by `kvpersist-operator pin-change-policy --write` from kvpersist.api.identity.id_fields. Do not edit.
# A Warning at `kubectl apply` when a change moves a KVCacheNamespace's namespace id (docs/api.md,
# "Before a pin change"): the same objects as {CONFIG_PATH} for kubectl users.
"""


def render_config() -> str:
    return HEADER + dump(policy(PLAIN_NAME)) + "---\n" + dump(binding(PLAIN_NAME))


# In namespaced mode (watchNamespaces) the binding matches those namespaces only (_helpers.tpl).
BINDING_SCOPE = '{{- include "kvpersist.bindingScope" . }}\n'


def render_template() -> str:
    return (CHART_HEADER + f"{{{{- if .Values.{VALUE}.enabled }}}}\n" + chart_doc(policy(PLAIN_NAME), POLICY) + "---\n"
            + chart_doc(binding(PLAIN_NAME), POLICY) + BINDING_SCOPE + "{{- end }}\n")


def write(root: Path) -> list[Path]:
    return policyfiles.write(root, ((CONFIG_PATH, render_config()), (TEMPLATE_PATH, render_template())))
