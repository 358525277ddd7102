"""The chart grants exactly what the operator's code and kopf's handlers need (tests/rbac_needs.py
derives it), in both of the chart's modes; a call the derivation cannot read fails here."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import rbac_needs as rb

PROBED = rb.PACKAGE_DIR / "controller" / "apply.py"  # one of the modules `kvpersist run` loads; it imports kube
SA, SA_NS = "kvpersist", "kvpersist-system"


@pytest.fixture(scope="module")
def rendered(helm: Path) -> dict[str, list[dict[str, Any]]]:
    """The chart as `helm template` renders it, per mode."""
    return {mode: rb.render(helm, mode) for mode in rb.MODES}


def _with_probe(code: str) -> dict[str, str]:
    """apply.py with a function appended that module-level code references (so it is reached)."""
    return {"kvpersist.controller.apply": PROBED.read_text() + "\n\n" + code + "\n_PROBES = [_probe]\n"}


def test_every_call_of_the_operator_is_understood() -> None:
    uses = rb.code_uses()
    assert uses, "no API call found: the derivation is looking in the wrong place"
    # A few mapping rules, each through a different path of the derivation:
    grants = {u.grant for u in uses}
    assert ("", "events", "list") in grants  # resources.get(kind="Event").get(field_selector=...): no name
    assert ("kvpersist.dev", "kvcachenamespaces/status", "patch") in grants  # request("patch", path + "/status")
    assert {("apps", "statefulsets", "patch"), ("apps", "statefulsets", "create")} <= grants  # server-side apply
    assert ("", "secrets", "get") in grants  # kube.get("v1", "Secret") <- agents.agent_token
    # Secrets are patched in one place only, their labels and annotations (kube.patch_metadata refuses
    # anything else): the generated L2 key kept out of GitOps prunes; never adopted, never its data.
    assert {u.where() for u in uses if u.grant == ("", "secrets", "patch")} == {
        "controller.kube.patch_metadata ← controller.retention.protect_retained"}
    # kube.list_all over ROUTE_KINDS: pairs stay together (never NetworkPolicy of v1).
    assert {("", "services", "delete"), ("networking.k8s.io", "networkpolicies", "delete")} <= grants


def test_admin_commands_are_not_the_operator() -> None:
    """Modules outside `kvpersist run` that call the API server run as someone else, and say who."""
    assert rb.modules_calling_the_api() <= rb.OTHER_IDENTITIES.keys(), rb.modules_calling_the_api()
    assert not any(u.call.module in rb.OTHER_IDENTITIES for u in rb.code_uses())


@pytest.mark.parametrize(("code", "grant"), [
    ("def _probe():\n    kube.delete('apps/v1', 'StatefulSet', 'n', 'ns')", ("apps", "statefulsets", "delete")),
    ("import kubernetes\ndef _probe():\n    kubernetes.client.CoreV1Api().list_namespaced_config_map('ns')",
     ("", "configmaps", "list")),
    ("import kubernetes\ndef _probe(name: str):\n    api = kubernetes.client.CustomObjectsApi()\n"
     "    api.patch_namespaced_custom_object_status('kvpersist.dev', 'v1alpha1', 'ns', 'kvcachenamespaces', name, {})",
     ("kvpersist.dev", "kvcachenamespaces/status", "patch")),
    ("import kubernetes\ndef _probe(name: str):\n    api = kubernetes.client.CustomObjectsApi()\n"
     "    api.delete_namespaced_custom_object('kvpersist.dev', 'v1alpha1', 'ns', 'kvcachenamespaces', name)",
     ("kvpersist.dev", "kvcachenamespaces", "delete")),
    ("def _probe():\n    for kind in ('ConfigMap', 'ServiceAccount'):\n        kube.get('v1', kind, 'n', 'ns')",
     ("", "serviceaccounts", "get")),
])
def test_a_new_call_is_picked_up_and_the_chart_check_fails(code: str, grant: rb.Grant, rendered: dict) -> None:
    granted = rb.chart_grants(rendered["clusterwide"], SA, SA_NS)
    with rb.analysing(_with_probe(code)):
        need = rb.needs("clusterwide")
        assert grant in need.required
        assert "controller.apply._probe" in "; ".join(need.required[grant])
        problems = rb.compare(need, granted)
    missing = [p for p in problems if p.startswith(f"missing grant {rb._fmt(grant)}:")]
    # Granted already (e.g. list configmaps, for the drift watch): no complaint; else named.
    assert len(missing) == (0 if grant in granted else 1), problems


@pytest.mark.parametrize("code", [
    "def _probe(obj):\n    kube.get('v1', obj.kind, 'n', 'ns')",  # which kind? unknown
    "import kubernetes\ndef _probe():\n    kubernetes.client.ApiClient().call_api('/api/v1/pods', 'GET')",
    "def _probe():\n    kube.client().request('get', '/api/v1/secrets')",  # a path not built from a resource
    "def _probe():\n    kube.apply({'apiVersion': 'v1', 'kind': 'NoSuchKind', 'metadata': {}})",
    "import kubernetes\ndef _probe():\n    kubernetes.client.CoreV1Api().connect_get_namespaced_pod_exec('p', 'ns')",
    "def _probe():\n    kube.client().resources.get(kind='Secret').get(name='x')",  # no api_version
])
def test_a_call_the_mapping_cannot_read_fails(code: str) -> None:
    with rb.analysing(_with_probe(code)), pytest.raises(rb.UnknownCall):
        rb.code_uses()


@pytest.mark.parametrize("mode", rb.MODES)
def test_chart_grants_exactly_what_is_needed(mode: str, rendered: dict) -> None:
    need = rb.needs(mode)
    granted = rb.chart_grants(rendered[mode], SA, SA_NS)
    assert not any("*" in part for grant in granted for part in grant), "wildcards in the chart's RBAC"
    problems = rb.compare(need, granted)
    assert problems == [], "\n".join(problems)


def _drop_verb(docs: list[dict[str, Any]], resource: str, verb: str) -> list[dict[str, Any]]:
    docs = copy.deepcopy(docs)
    for doc in docs:
        for rule in doc.get("rules") or [] if doc["kind"] in ("ClusterRole", "Role") else []:
            if resource in rule.get("resources", []) and verb in rule.get("verbs", []):
                rule["verbs"].remove(verb)
    return docs


def test_the_chart_check_can_fail(rendered: dict) -> None:
    """A verb taken from the rendered chart is missing; one added is unused."""
    docs = rendered["clusterwide"]
    need = rb.needs("clusterwide")
    problems = rb.compare(need, rb.chart_grants(_drop_verb(docs, "events", "list"), SA, SA_NS))
    assert len(problems) == 1 and problems[0].startswith("missing grant list events: needed by "), problems
    assert "controller.refresh._observe.statefulset_failure" in problems[0]
    extra = copy.deepcopy(docs)
    role = next(d for d in extra if d["kind"] == "ClusterRole" and d["metadata"]["name"] == SA)
    role["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["delete"]})
    assert rb.compare(need, rb.chart_grants(extra, SA, SA_NS)) == [
        "unused grant delete secrets (ClusterRole kvpersist): no code or kopf handler needs it"]


def test_kopf_keeps_no_state_on_the_resource() -> None:
    """kvpersist's startup handler keeps any kopf progress out of status (which the schema owns), and
    only kopf's event handlers run on the resource (controller.tracking), so kopf patches neither
    the resource nor its status: a new resource costs no bookkeeping patch."""
    import kopf

    settings = rb.kopf_settings()
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    kopf_grants = {n.grant for n in rb.kopf_needs("clusterwide")}
    assert ("kvpersist.dev", "kvcachenamespaces", "patch") not in kopf_grants
    assert ("kvpersist.dev", "kvcachenamespaces/status", "patch") not in kopf_grants


def test_security_doc_table_is_current() -> None:
    text = rb.DOCS.read_text()
    assert rb.docs_block() in text, "docs/security.md's RBAC table is stale: python -m tests.rbac_needs --write-docs"


@pytest.mark.parametrize("mode", rb.MODES)
def test_each_grant_holds_where_it_is_needed_and_nowhere_else(mode: str, rendered: dict) -> None:
    """Cluster-wide mode: one ClusterRole. Namespaced mode: every namespaced grant in a Role of
    each watched namespace, none cluster-wide (a ClusterRole reaching StatefulSets or pods is every
    namespace's, kube-system's included), nothing in another namespace."""
    watched = rb.WATCHED if mode == "namespaced" else ()
    problems = rb.scope_problems(rb.needs(mode), rendered[mode], SA, SA_NS, watched)
    assert problems == [], "\n".join(problems)


ADMISSION_CHECK = {("admissionregistration.k8s.io", r, v) for r in ("validatingadmissionpolicies",
                   "validatingadmissionpolicybindings") for v in ("list", "watch")}


def test_namespaced_mode_needs_nothing_cluster_wide(rendered: dict) -> None:
    """With exact namespace names kopf scans neither namespaces nor CRDs and peers per namespace,
    and the operator lists the watched namespaces one by one: no cluster-scoped resource is
    needed but the creator-rights policy and its binding, watched by name to say whether they exist
    (kvpersist.controller.admissioncheck), so the chart renders no ClusterRole for the operator
    but one that lists and watches those two objects by name."""
    assert rb.cluster_scoped(rb.needs("namespaced")) == ADMISSION_CHECK
    [check] = [d for d in rendered["namespaced"] if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-admission-check")]
    assert [(r["resources"], r["resourceNames"], r["verbs"]) for r in check["rules"]] == [
        (["validatingadmissionpolicies", "validatingadmissionpolicybindings"], [f"{SA}-creator-rights"], ["list", "watch"])]
    assert {("apiextensions.k8s.io", "customresourcedefinitions", "list"),
            ("kopf.dev", "clusterkopfpeerings", "patch")} <= rb.cluster_scoped(rb.needs("clusterwide"))  # not vacuous
    docs = rendered["namespaced"]
    scoped = rb.scoped_grants(docs, SA, SA_NS)
    assert scoped.keys() == {*rb.WATCHED, None} and set(scoped[None]) == ADMISSION_CHECK
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding") and d["metadata"]["name"] == SA]


def test_the_scope_check_can_fail(rendered: dict) -> None:
    """The namespaced chart plus today's-main-style ClusterRole of namespaced rights is refused,
    naming them; a verb dropped from one watched namespace's Role is missing there only."""
    need = rb.needs("namespaced")
    docs = copy.deepcopy(rendered["namespaced"])
    clusterwide = rendered["clusterwide"]
    docs += [copy.deepcopy(d) for d in clusterwide if d["kind"] in ("ClusterRole", "ClusterRoleBinding")
             and d["metadata"]["name"] == SA]
    problems = rb.scope_problems(need, docs, SA, SA_NS, rb.WATCHED)
    assert any(p.startswith("cluster-wide grant create statefulsets.apps (ClusterRole kvpersist): a namespaced") for p in problems)
    assert any(p.startswith("cluster-wide grant list pods (ClusterRole kvpersist)") for p in problems), problems
    docs = copy.deepcopy(rendered["namespaced"])
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["namespace"] == "team-b")
    for rule in role["rules"]:
        if "deployments" in rule["resources"]:
            rule["resources"].remove("deployments")
    assert rb.scope_problems(need, docs, SA, SA_NS, rb.WATCHED) == [
        f"missing grant {v} deployments.apps in team-b" for v in ("create", "list", "patch", "watch")]
    # A Role of the operator's rights in a namespace it does not watch.
    stray = copy.deepcopy([d for d in rendered["namespaced"] if d["kind"] in ("Role", "RoleBinding")
                           and d["metadata"]["namespace"] == "team-a"])
    for d in stray:
        d["metadata"]["namespace"] = "kube-system"
    problems = rb.scope_problems(need, rendered["namespaced"] + stray, SA, SA_NS, rb.WATCHED)
    assert len(problems) == 1 and problems[0].startswith("grants in namespace kube-system, which is not watched: "), problems


@pytest.mark.parametrize(("value", "says"), [
    ("{team-*}", "does not match pattern"),  # the values schema
    ("{a,a}", "are equal"),
])
def test_watch_namespaces_takes_exact_names_only(helm: Path, value: str, says: str) -> None:
    """A pattern names no namespace to put a Role in: refused, by the values schema and (with
    --skip-schema-validation) by the template, saying what to do."""
    def template(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(helm), "template", "r", str(rb.CHART),
                               "--set", f"watchNamespaces={value}", *extra],
                              capture_output=True, text=True, timeout=120)

    out = template()
    assert out.returncode != 0 and says in out.stderr, out.stderr
    out = template("--skip-schema-validation")
    assert out.returncode != 0, out.stdout[:500]
    assert "watchNamespaces[" in out.stderr and ("only exact namespace names" in out.stderr
                                                 or "listed twice" in out.stderr), out.stderr
