"""A GitOps prune never reaches persisted KV or its key (issue 27, item 8), on the real API server
with real lmcache servers.

What outlives a KVCacheNamespace has no owner on purpose (the generated L2 key Secret, the L2
claims), and so is what a prune can take: `kubectl apply --prune -l app.kubernetes.io/instance=NAME`
deletes what the selector matches and carries kubectl's last-applied annotation (a key Secret
restored from a backup with `kubectl apply` does); Argo CD with label tracking prunes every unowned
object whose app.kubernetes.io/instance names the Application and that git lacks, unless it says
Prune=false (gitops-engine pkg/cache/cluster.go GetManagedLiveObjs: managed and no owner
references; its sync skips Prune=false). Argo CD itself cannot run here (no images): its rule is
applied, as written there, to every object the cluster holds in the namespace; kubectl's prune runs
for real.

The objects as an earlier version left them are made by hand first: the key Secret with the
tracking label, restored with kubectl apply, and a retained claim of a resource deleted back then.
The StatefulSet is left as it is (its selector and volumeClaimTemplates cannot change): a spec
change still applies and rolls, and the claims keep their protection.
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpersist.identity import key_fingerprint
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, bench_store, kvpersist_env, manifest
from tests.fsstate import files_state

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]

LMCACHE = shutil.which("lmcache")
TRACKING = "app.kubernetes.io/instance"
GONE = "gone-before"  # a resource deleted under an earlier version; its claim retained
# Every namespaced kind the operator makes or that a StatefulSet makes for it.
KINDS = "secrets,persistentvolumeclaims,configmaps,services,statefulsets,deployments,networkpolicies,pods"


def argocd_would_prune(obj: dict[str, Any], application: str) -> bool:
    """Argo CD (label tracking, automated prune) prunes a live object git lacks when it tracks it
    (its app.kubernetes.io/instance is the Application's name), nothing owns it (owned objects are
    not managed live objects: gitops-engine GetManagedLiveObjs) and it does not say Prune=false."""
    meta = obj["metadata"]
    options = [o.strip() for o in (meta.get("annotations") or {}).get("argocd.argoproj.io/sync-options", "").split(",")]
    return ((meta.get("labels") or {}).get(TRACKING) == application and not meta.get("ownerReferences")
            and "Prune=false" not in options)


def prunable(k: Kubectl, ns: str, application: str, in_git: tuple[str, ...] = ()) -> list[str]:
    """What Argo CD would prune for the Application: live objects it tracks that git lacks."""
    items = json.loads(k.run("get", KINDS, "-n", ns, "-o", "json").stdout)["items"]
    return sorted(ref for o in items if (ref := f"{o['kind']}/{o['metadata']['name']}") not in in_git
                  and argocd_would_prune(o, application))


def kubectl_prune(k: Kubectl, ns: str, application: str, manifests: list[dict[str, Any]], tmp: Path) -> str:
    """`kubectl apply --prune` of an application's manifests by its instance label, as a pipeline
    that keeps a namespace in sync with a folder does."""
    folder = tmp / f"app-{application}"
    folder.mkdir(exist_ok=True)
    (folder / "all.json").write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests}))
    out = k.run("apply", "-n", ns, "-f", str(folder), "--prune", "-l", f"{TRACKING}={application}",
                "--prune-allowlist=core/v1/Secret", "--prune-allowlist=core/v1/PersistentVolumeClaim",
                "--prune-allowlist=core/v1/ConfigMap")
    return out.stdout


@pytest.fixture(scope="module")
def scenario(kubectl: Kubectl, crd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if LMCACHE is None:
        pytest.fail("lmcache not on PATH: run through hack/test.sh (installs the datapath extra)")
    with kvpersist_env(kubectl, tmp_path_factory.mktemp("prune")) as env:
        yield {"ns": env.ns, "env": env, "tmp": env.work}


def app_manifest(ns: str) -> dict[str, Any]:
    """The resource as git holds it, labelled with its Application's name."""
    obj = manifest(ns)
    obj["metadata"].setdefault("labels", {})[TRACKING] = NAME
    return obj


def test_kubectl_apply_prune_leaves_the_key(kubectl: Kubectl, scenario: dict) -> None:
    ns, tmp = scenario["ns"], scenario["tmp"]
    key = secrets.token_bytes(32)
    # As an earlier version made it (tracking label, no owner), then restored from a backup with kubectl apply.
    kubectl.apply({"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {
        "name": f"{NAME}-l2-key", "namespace": ns, "labels": {
            "app.kubernetes.io/name": "kvpersist", TRACKING: NAME, "app.kubernetes.io/component": "l2-key",
            "app.kubernetes.io/managed-by": "kvpersist"}}, "data": {"master-key": base64.b64encode(key).decode()}})
    # A claim an earlier version's StatefulSet made for a resource deleted since (retained, unowned).
    kubectl.run("create", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": f"l2-{GONE}-lmcache-0", "namespace": ns, "labels": {
            "app.kubernetes.io/name": "kvpersist", TRACKING: GONE, "app.kubernetes.io/component": "lmcache-server"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                 "storageClassName": f"{ns}-nvme"}}))
    kubectl.run("apply", "-f", "-", stdin=json.dumps(app_manifest(ns)))  # client-side, as a kubectl pipeline applies
    wait_for("Ready", lambda: (kubectl.get("kvns", NAME, ns).get("status") or {}).get("phase") == "Ready", timeout=300,
             interval=1)
    claim = f"l2-{NAME}-lmcache-0"
    volume = scenario["env"].volume()
    ip = kubectl.get("pod", f"{NAME}-lmcache-0", ns)["status"]["podIP"]
    bench_store(ip, 0, 2)  # persisted KV, sealed with that key
    looks: list[dict] = []

    def settled() -> dict | None:  # the server's asynchronous L2 writes landed: two equal looks, not empty
        looks.append({p.name: files_state(p) for p in volume.iterdir() if p.is_dir()})
        return looks[-1] if any(looks[-1].values()) and looks[-2:-1] == looks[-1:] else None

    before = wait_for("the stored KV on the volume", settled, timeout=60, interval=2)

    pruned = kubectl_prune(kubectl, ns, NAME, [app_manifest(ns)], tmp)
    assert "pruned" not in pruned, pruned  # the previous main: secret/llama31-8b-l2-key pruned
    secret = kubectl.get("secret", f"{NAME}-l2-key", ns)
    assert base64.b64decode(secret["data"]["master-key"]) == key  # the same key, still there
    assert TRACKING not in secret["metadata"]["labels"] and secret["metadata"]["labels"]["kvpersist.dev/instance"] == NAME
    assert "Prune=false" in secret["metadata"]["annotations"]["argocd.argoproj.io/sync-options"]
    assert {p.name: files_state(p) for p in volume.iterdir() if p.is_dir()} == before
    scenario.update(key=key, claim=claim)


def test_argo_cd_would_prune_nothing_it_tracks(kubectl: Kubectl, scenario: dict) -> None:
    """Argo CD's rule over every object in the namespace: nothing tracked by the Application (or by
    the deleted resource's, for the old claim) is unowned and prunable, and the claims carry the
    annotations Argo CD and Flux honour."""
    ns, claim = scenario["ns"], f"l2-{NAME}-lmcache-0"
    assert prunable(kubectl, ns, NAME) == [] and prunable(kubectl, ns, GONE) == []
    for name, owner in ((claim, NAME), (f"l2-{GONE}-lmcache-0", GONE)):
        meta = kubectl.get("pvc", name, ns)["metadata"]
        assert TRACKING not in meta["labels"] and meta["labels"]["kvpersist.dev/instance"] == owner, meta
        assert meta["annotations"]["kustomize.toolkit.fluxcd.io/prune"] == "disabled"
    # The claim records the key its data needs (the one in the Secret; never the key itself).
    fingerprint = key_fingerprint(base64.b64decode(kubectl.get("secret", f"{NAME}-l2-key", ns)["data"]["master-key"]))
    assert kubectl.get("pvc", claim, ns)["metadata"]["annotations"]["kvpersist.dev/l2-key-fingerprint"] == fingerprint
    assert kubectl.get("kvns", NAME, ns)["status"]["l2Key"]["fingerprint"] == fingerprint


def test_the_statefulset_as_it_was_keeps_applying_and_the_claims_stay_protected(kubectl: Kubectl, scenario: dict) -> None:
    """The claims were fixed where they are; the StatefulSet's template (immutable in part) was not
    touched: a spec change is applied and rolled out, and nothing puts the tracking label back."""
    ns = scenario["ns"]
    before = kubectl.get("statefulset", f"{NAME}-lmcache", ns)
    changed = app_manifest(ns)
    changed["spec"]["l1"]["size"] = "512Mi"
    kubectl.run("apply", "-f", "-", stdin=json.dumps(changed))
    wait_for("the servers rolled with 0.5 GiB of L1", lambda: (lambda s: s.get("phase") == "Ready" and (s.get("usage") or {}).get(
        "l1CapacityBytes") == 2**29)(kubectl.get("kvns", NAME, ns).get("status") or {}), timeout=300, interval=1)
    after = kubectl.get("statefulset", f"{NAME}-lmcache", ns)
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    assert prunable(kubectl, ns, NAME) == []
    assert TRACKING not in kubectl.get("pvc", scenario["claim"], ns)["metadata"]["labels"]


def test_after_the_resource_is_deleted_a_prune_still_takes_nothing(kubectl: Kubectl, scenario: dict, tmp_path: Path) -> None:
    """The Application drops the resource (git no longer has it): the resource goes with what it
    owns; the claim and the key stay, and a prune of the Application's label leaves them."""
    ns = scenario["ns"]
    kubectl.run("delete", "kvns", NAME, "-n", ns, timeout=120)
    wait_for("the StatefulSet collected", lambda: kubectl.run("get", "statefulset", f"{NAME}-lmcache", "-n", ns,
                                                            check=False).returncode != 0, timeout=120, interval=1)
    remaining = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app-settings", "namespace": ns,
                                                                       "labels": {TRACKING: NAME}}, "data": {"a": "b"}}
    out = kubectl_prune(kubectl, ns, NAME, [remaining], tmp_path)
    assert "pruned" not in out, out
    assert prunable(kubectl, ns, NAME, in_git=("ConfigMap/app-settings",)) == []
    assert base64.b64decode(kubectl.get("secret", f"{NAME}-l2-key", ns)["data"]["master-key"]) == scenario["key"]
    assert kubectl.get("pvc", scenario["claim"], ns)["status"]["phase"] == "Bound"
