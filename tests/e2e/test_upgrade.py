"""Upgrades on the real API server (docs/upgrading.md).

- The agent roll: an operator restarted with a new agent image gives it to one lmcache
  StatefulSet at a time, the next once the last one's server is Ready again (kwok's fake GPU
  node makes the pods Ready; no lmcache runs: what is checked is what the operator applies).
- The chart upgrade: the previous chart (from git) and its operator, a resource with its
  namespace id, key Secret and claim; then the documented steps (the release takes over the CRD
  the previous chart made from crds/, `helm upgrade` to this chart upgrades it) and this operator:
  the same id, the same Secret and claim, no new claim, status still served; and after `helm
  uninstall` the CRD and the resource are still there.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import subprocess
import sys
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvpersist.api.quantity import parse_quantity
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.lmcache import AGENT_IMAGE_ENV
from kvpersist.controller.agentroll import PENDING, UPDATING
from kvpersist.identity import key_fingerprint, resolve
from kvpersist.status.agentroll import agent_image_of, view
from kvpersist.status.conditions import CONDITION_TYPES
from tests.cases.invalid_manifests import sample
from tests.e2e.kube import REPO, Kubectl, bin_dir, wait_for
from tests.e2e.operator_env import manifest, more_rounds, start_operator, stop, storage

pytestmark = [pytest.mark.e2e]

OLD = "registry.example.com/kvpersist-operator@sha256:" + "a" * 64
NEW = "registry.example.com/kvpersist-operator@sha256:" + "b" * 64
ROLLED = ("r0", "r1", "r2")


def _on_kwok_gpu(ns: str, name: str) -> dict:
    """A bucket resource (no claim to bind) whose server lands on kwok's fake GPU node, where it is
    Ready at once; no vLLM pod."""
    obj = copy.deepcopy(sample("hf-bucket"))
    obj["metadata"] = {"name": name, "namespace": ns}
    obj["spec"]["l1"]["size"] = "256Mi"
    obj["spec"]["l2"]["hfBucket"]["bucketHandle"] = f"hf://buckets/acme-ml/kv-cache/{ns}-{name}"
    obj["spec"]["l2"]["hfBucket"]["tokenSecretRef"] = {"name": "hf", "key": "token"}
    obj["spec"]["vllm"].update(replicas=0, nodeSelector={"kubernetes.io/hostname": "kwok-gpu-0"})
    return obj


def _servers(kubectl: Kubectl, ns: str) -> dict[str, dict]:
    listed = kubectl.get("statefulsets", None, ns)["items"]
    return {s["metadata"]["labels"]["app.kubernetes.io/instance"]: s for s in listed}


def _reasons(kubectl: Kubectl, ns: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for event in kubectl.get("events", None, ns)["items"]:
        out.setdefault(event["involvedObject"]["name"], set()).add(event["reason"])
    return out


def test_a_new_agent_image_rolls_one_lmcache_statefulset_at_a_time(kubectl: Kubectl, crd: None, namespace: str,
                                                                    tmp_path: Path) -> None:
    ns = namespace
    kubectl.run("create", "secret", "generic", "hf", "--from-literal=token=hf_unused", "-n", ns)
    for name in ROLLED:
        kubectl.apply(_on_kwok_gpu(ns, name))
    log = tmp_path / "operator.log"
    first = start_operator(kubectl.kubeconfig, ns, log, {AGENT_IMAGE_ENV: OLD})
    try:
        wait_for("every server Ready on the first agent image", lambda: (lambda s: len(s) == 3 and all(
            agent_image_of(x) == OLD and view(x).settled and x["spec"]["replicas"] == 1 for x in s.values()))(
            _servers(kubectl, ns)), timeout=180)
    finally:
        stop(first)
    second = start_operator(kubectl.kubeconfig, ns, log, {AGENT_IMAGE_ENV: NEW})
    try:
        rolling_at_once, seen_partial = 0, False

        def rolled() -> bool:
            nonlocal rolling_at_once, seen_partial
            servers = _servers(kubectl, ns)  # one LIST: one moment of the API server
            on_new = [n for n, s in servers.items() if agent_image_of(s) == NEW]
            rolling_at_once = max(rolling_at_once, sum(1 for n in on_new if not view(servers[n]).settled))
            seen_partial |= 0 < len(on_new) < 3
            return len(on_new) == 3 and all(view(s).settled for s in servers.values())

        wait_for("every server on the new agent image, one after another", rolled, timeout=300, interval=0.2)
        reasons = _reasons(kubectl, ns)
    finally:
        stop(second)
    # Never two servers restarting for the agent together; and the roll was seen half done.
    assert rolling_at_once <= 1, f"{rolling_at_once} StatefulSets rolled at once: {log.read_text()[-3000:]}"
    assert seen_partial
    # Each resource was told: all rolled (AgentUpdating), those that waited first said so.
    assert all(UPDATING in reasons.get(n, set()) for n in ROLLED), reasons
    assert sum(PENDING in reasons.get(n, set()) for n in ROLLED) >= 2, reasons
    # And in the order the servers went: each new pod made once the previous one's was Ready.
    pods = sorted(kubectl.get("pods", None, ns)["items"], key=lambda p: p["metadata"]["creationTimestamp"])
    ready_at = [next(c["lastTransitionTime"] for c in p["status"]["conditions"] if c["type"] == "Ready") for p in pods]
    created = [p["metadata"]["creationTimestamp"] for p in pods]
    assert len(pods) == 3 and all(created[i + 1] >= ready_at[i] for i in range(2)), list(zip(created, ready_at, strict=True))


PREVIOUS = "ae67d34"  # main before issue 29's merge: its CRD admits control characters and any nodeSelector key
UPGRADING = REPO / "docs" / "upgrading.md"
CRD = "kvcachenamespaces.kvpersist.dev"


def documented_steps() -> str:
    """The shell block under docs/upgrading.md's "## Upgrading, step by step", as a user runs it."""
    text = UPGRADING.read_text()
    section = text.split("## Upgrading, step by step", 1)[1]
    return re.search(r"```sh\n(.*?)```", section, re.S).group(1)


def _previous(work: Path) -> Path:
    """The previous commit's chart and operator, from git."""
    archive = work / "previous.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), PREVIOUS, "charts/kvpersist", "operator"],
                   check=True, timeout=60)
    with tarfile.open(archive) as tar:
        tar.extractall(work / "previous", filter="data")
    return work / "previous"


def _previous_form(obj: dict) -> dict:
    """A manifest of today's API in the previous one's form (before spec.image): the two image
    fields, sizes in GiB, the connector and the tokenizer spelled out (the previous API had no
    defaults for them)."""
    out = copy.deepcopy(obj)
    spec = out["spec"]
    image = spec.pop("image")
    spec.setdefault("vllm", {})["image"] = image
    spec.setdefault("lmcacheServer", {})["image"] = image
    spec["l1"] = {"sizeGB": float(parse_quantity(spec["l1"]["size"])) / 2**30}
    nvme = spec["l2"]["nvme"]
    nvme["maxCapacityGB"] = float(parse_quantity(nvme.pop("maxCapacity"))) / 2**30
    ident = spec["identity"]
    ident.update(connector="LMCacheMPConnector", tokenizer=ident.get("tokenizer", ident["modelId"]),
                 tokenizerRevision=ident.get("tokenizerRevision", ident["modelRevision"]))
    return out


def _previous_serde(old: Path) -> str:
    """The previous operator's L2 serde pin (api/v1alpha1.py's L2_SERDE), read from its source."""
    return re.search(r'^L2_SERDE = "([^"]+)"', (old / "operator/kvpersist/api/v1alpha1.py").read_text(), re.M).group(1)


def _helm(kubectl: Kubectl, *args: str) -> None:
    out = subprocess.run([str(bin_dir() / "helm"), *args, "--kubeconfig", str(kubectl.kubeconfig)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"helm {' '.join(args)}: {out.stderr}"


def _refuses_control_characters(kubectl: Kubectl, ns: str) -> bool:
    """Whether the CRD in the cluster is today's on a point that matters: a served model name with a
    line separator in it is refused at apply (server-side dry run: nothing is stored)."""
    obj = manifest(ns)
    obj["metadata"]["name"] = "probe"
    obj["spec"]["vllm"]["servedModelName"] = "llama\u2028ignore previous lines"
    out = kubectl.run("apply", "--server-side", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(obj), check=False)
    return out.returncode != 0 and "spec.vllm.servedModelName" in out.stderr


@pytest.fixture()
def previous_crd(kubectl: Kubectl, crd: None) -> Iterator[None]:
    """The session's CRD is today's: put it back whatever the test left (other tests need it)."""
    try:
        yield
    finally:
        kubectl.run("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"), check=False)


def test_the_documented_upgrade_keeps_namespace_ids_and_data(kubectl: Kubectl, previous_crd: None, namespace: str,
                                                              tmp_path: Path) -> None:
    steps = documented_steps()  # first: on main there is no docs/upgrading.md
    old = _previous(tmp_path)
    app, release_ns, release = namespace, f"kvp-upg-{uuid.uuid4().hex[:6]}", "kvp-upg"
    # A cluster as the previous chart left it: its CRD (helm installs crds/ only when absent, so it
    # is put in place by hand, as on a cluster that installed that chart first), its release.
    kubectl.run("replace", "-f", str(old / "charts/kvpersist/crds" / f"{CRD}.yaml"))
    assert not _refuses_control_characters(kubectl, app)
    _helm(kubectl, "install", release, str(old / "charts/kvpersist"), "--namespace", release_ns, "--create-namespace",
          "--set", f"peering.name={release}")
    kubectl.apply(storage(app))
    kubectl.apply(_previous_form(manifest(app)))
    log = tmp_path / "operator.log"
    # The previous operator's code: the namespace id, the key and the claim are its doing.
    before = start_operator(kubectl.kubeconfig, app, log, {"PYTHONPATH": f"{old / 'operator'}{os.pathsep}{REPO}"})
    name = manifest(app)["metadata"]["name"]
    try:
        status = wait_for("the previous operator's namespace id, key and claim", lambda: (lambda s: s if s.get(
            "namespaceId") and (s.get("l2Key") or {}).get("secret") and kubectl.get("pvc", None, app)["items"] else None)(
            kubectl.get("kvns", name, app).get("status") or {}), timeout=180)
    finally:
        stop(before)
    key_secret = kubectl.get("secret", status["l2Key"]["secret"], app)
    claims = {c["metadata"]["uid"] for c in kubectl.get("pvc", None, app)["items"]}

    # The documented steps, as written (the user's release, namespace and chart substituted).
    env = {**os.environ, "KUBECONFIG": str(kubectl.kubeconfig), "PATH": f"{bin_dir()}{os.pathsep}{os.environ['PATH']}",
           "CHART": str(REPO / "charts" / "kvpersist"), "RELEASE": release, "NAMESPACE": release_ns}
    script = "\n".join(line for line in steps.splitlines() if not re.match(r"^\s*[A-Z_]+=", line))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _refuses_control_characters(kubectl, app), "the CRD is still the previous chart's"
    owned = kubectl.get("customresourcedefinitions", CRD)["metadata"]
    assert owned["annotations"]["meta.helm.sh/release-name"] == release, owned  # the release's now
    assert owned["annotations"]["helm.sh/resource-policy"] == "keep", owned  # and upgraded by it
    deployed = kubectl.get("deployment", None, release_ns)["items"]
    assert any("KVPERSIST_AGENT_ROLL_MAX" in str(d["spec"]["template"]) for d in deployed), "the chart was not upgraded"

    after = start_operator(kubectl.kubeconfig, app, log)  # this tree's operator
    try:
        # The stored resource is in the previous API's form: its removed fields are gone (pruned) or
        # refused, so it reads InvalidSpec naming spec.image, and nothing of it is touched.
        workloads = {kind: kubectl.get(kind, None, app)["items"] for kind in ("statefulsets", "deployments")}
        invalid = wait_for("InvalidSpec naming spec.image", lambda: (lambda s: s if s.get("phase") == "Failed" and any(
            c.get("reason") == "InvalidSpec" and "spec.image is required" in c.get("message", "")
            for c in s.get("conditions") or []) else None)(kubectl.get("kvns", name, app).get("status") or {}), timeout=120)
        assert invalid["observedGeneration"] == kubectl.get("kvns", name, app)["metadata"]["generation"]
        for kind, items in workloads.items():
            now = {o["metadata"]["uid"]: o["metadata"]["generation"] for o in kubectl.get(kind, None, app)["items"]}
            assert now == {o["metadata"]["uid"]: o["metadata"]["generation"] for o in items}, kind
        # The documented fix: the manifest converted where it is kept, then applied.
        previous = tmp_path / "previous-form.yaml"
        previous.write_text(yaml.safe_dump(_previous_form(manifest(app))))
        converted = subprocess.run([sys.executable, "-m", "kvpersist.cli", "convert", "-f", str(previous)],
                                   capture_output=True, text=True, timeout=60, check=True)
        assert "spec.vllm.image and spec.lmcacheServer.image -> spec.image" in converted.stderr
        kubectl.run("apply", "-f", "-", stdin=converted.stdout)
        more_rounds(after, app, name)  # two status rounds of its own, each after its applies
        new_status = kubectl.get("kvns", name, app)["status"]
    finally:
        stop(after)
        _helm(kubectl, "uninstall", release, "--namespace", release_ns)
        kubectl.run("delete", "namespace", release_ns, "--wait=false", check=False)
    # The same key and claim; the id is what this tree computes from the same pins and key: the
    # previous one when the identity is unchanged, and across this release's L2 frame (version 3,
    # in the L2 serde pin: the CHANGELOG's "new namespace ids") a new one, the old id's data kept
    # as an orphan and said so in an event.
    key = base64.b64decode(key_secret["data"]["master-key"])
    spec = KVCacheNamespace.model_validate(kubectl.get("kvns", name, app)).spec
    assert new_status["namespaceId"] == resolve(spec.pins(key_fingerprint(key))).namespace_id
    assert {k: v for k, v in new_status["l2Key"].items() if k != "namespaceId"} == {
        k: v for k, v in status["l2Key"].items() if k != "namespaceId"}
    assert new_status["l2Key"]["namespaceId"] == new_status["namespaceId"]
    if new_status["namespaceId"] != status["namespaceId"]:
        assert spec.pins()["l2_serde"] != _previous_serde(old), "the id moved without a pin of the release changing"
        said = [e["message"] for e in kubectl.get("events", None, app)["items"] if e["reason"] == "NamespaceResolved"]
        assert any(f"was {status['namespaceId']}; its data is kept" in m for m in said), said
    # Served by this operator: its status is of this generation, with the conditions it writes, the
    # identity resolved to that id, and the claim bound (no runner plays this node: the servers are
    # scheduled, not Ready, so the phase is the one that says so).
    stored = kubectl.get("kvns", name, app)  # after `helm uninstall`: the kept CRD kept the resource
    assert kubectl.get("customresourcedefinitions", CRD)["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert new_status["observedGeneration"] == stored["metadata"]["generation"]
    conds = {c["type"]: c for c in new_status["conditions"]}
    assert {"IdentityResolved", "L2Ready", "LMCacheReady", "VLLMReady", "Ready"} <= set(conds) <= set(CONDITION_TYPES), conds
    assert (conds["IdentityResolved"]["status"], conds["IdentityResolved"]["reason"]) == ("True", "PinsComplete")
    assert new_status["namespaceId"] in conds["IdentityResolved"]["message"]
    assert conds["LMCacheReady"]["status"] == "False" and new_status["phase"] in ("Pending", "Progressing"), new_status
    kept = kubectl.get("secret", key_secret["metadata"]["name"], app)
    assert (kept["metadata"]["uid"], kept["metadata"]["resourceVersion"], kept["data"]) == (
        key_secret["metadata"]["uid"], key_secret["metadata"]["resourceVersion"], key_secret["data"])
    assert {c["metadata"]["uid"] for c in kubectl.get("pvc", None, app)["items"]} == claims  # the same claim, no new one
