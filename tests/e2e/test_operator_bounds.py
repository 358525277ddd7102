"""What the operator's own ServiceAccount may create, on the real API server: the chart's
operator-bounds ValidatingAdmissionPolicy (rendered with an image allow-list) refuses, from that
account only, a StatefulSet or Deployment kvpersist never renders (privileged, hostPath, a host
namespace or port, an added capability, a ServiceAccount token, an image under no allowed prefix,
without the operator's labels or its KVCacheNamespace as controller, or one someone else made),
naming the reason, and admits what the builders render for each sample, created and applied again.

The account is impersonated (`kubectl --as=system:serviceaccount:NS:kvpersist
--as-group=system:serviceaccounts`) with a Role giving it the chart's verbs on workloads in the
test namespace; no operator runs, so admission is the API server's alone. Without the policy each
refused object here is admitted (the same objects from the cluster admin are, below)."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import kopf
import pytest
import yaml

from kvpersist.builders.all import build_all
from kvpersist.controller.policy import image_allowed
from tests.cases.invalid_manifests import sample
from tests.e2e.kube import REPO, Kubectl, bin_dir, wait_for
from tests.e2e.operator_env import target_of
from tests.unit.test_operator_bounds import REFUSED, SAMPLES

pytestmark = pytest.mark.e2e
RELEASE = "kvpersist"
POLICY = f"{RELEASE}-operator-bounds"
# The samples' image, and one prefix of each form docs/security.md ("How image prefixes are
# matched") describes: whole components, Docker Hub's full form, a bare host, tags only, digests only.
PREFIXES = ("registry.example.com/kvpersist/vllm-lmcache", "registry.example.com/lmcache", "docker.io/vllm/",
            "reg.example.com", "quay.io/x/server:", "quay.io/y/z@")
DIGEST = "@sha256:" + "e3" * 32
IMAGES = ("registry.example.com/lmcache", "registry.example.com/lmcache/server" + DIGEST, "registry.example.com/lmcache:v1",
          "registry.example.com/lmcache-evil/x:v1", "registry.example.com/lmcachex:v1", "vllm/vllm-openai:v0.33.0",
          "docker.io/vllm/vllm-openai:v1", "index.docker.io/vllm/vllm-openai:v1", "vllmx/vllm-openai:v1", "ubuntu:24.04",
          "reg.example.com/x:v1", "reg.example.com:5000/x:v1", "reg.example.com.evil.io/x:v1", "quay.io/x/server:v1",
          "quay.io/x/server" + DIGEST, "quay.io/y/z" + DIGEST, "quay.io/y/z:v1", "localhost/lmcache:v1",
          "registry.example.com/kvpersist/vllm-lmcache-evil:v1")


def as_operator(kubectl: Kubectl, account: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return kubectl.run(f"--as={account}", "--as-group=system:serviceaccounts", *args, stdin=stdin, check=False)


@pytest.fixture(scope="module")
def bounded(kubectl: Kubectl, crd: None) -> Iterator[dict[str, Any]]:
    """The chart's policy for a release in its own namespace (allowedImages: PREFIXES), a test
    namespace where its account may write workloads, and each sample created there by the admin
    (the owners the rendered workloads name)."""
    release_ns, ns = f"kvp-sys-{uuid.uuid4().hex[:6]}", f"e2e-{uuid.uuid4().hex[:8]}"
    account = f"system:serviceaccount:{release_ns}:{RELEASE}"
    out = subprocess.run([str(bin_dir() / "helm"), "template", RELEASE, str(REPO / "charts" / "kvpersist"), "--namespace", release_ns,
                          "--show-only", "templates/operator-bounds.yaml",
                          "--set", "allowedImages={" + ",".join(PREFIXES) + "}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    policy = out.stdout
    kubectl.run("apply", "--server-side", "-f", "-", stdin=policy)
    try:
        checked = wait_for(f"the API server to type-check {POLICY}", lambda: (lambda p: p if (p.get("status") or {}).get(
            "observedGeneration") == p["metadata"]["generation"] else None)(kubectl.get("validatingadmissionpolicy", POLICY)),
            timeout=60)
        assert not (checked["status"].get("typeChecking") or {}).get("expressionWarnings"), checked["status"]
        kubectl.run("create", "namespace", ns)
        kubectl.run("create", "role", "workloads", "-n", ns, "--verb=create,get,list,patch,update",
                    "--resource=statefulsets.apps,deployments.apps")
        kubectl.run("create", "rolebinding", "workloads", "-n", ns, "--role=workloads", f"--serviceaccount={release_ns}:{RELEASE}")
        wait_for("the account's rights", lambda: as_operator(kubectl, account, "auth", "can-i", "patch", "statefulsets.apps",
                                                               "-n", ns).returncode == 0, timeout=60)
        owners = {}
        for name in SAMPLES:
            obj = sample(name)
            obj["metadata"]["namespace"] = ns
            kubectl.apply(obj)
            owners[name] = kubectl.get("kvns", obj["metadata"]["name"], ns)
        state = {"ns": ns, "account": account, "owners": owners}
        # The binding reaches the admission plugin a moment after it is written (at most 60 s).
        bad = json.dumps(refused_object(state, "privileged"))
        deadline = time.monotonic() + 60
        while POLICY not in as_operator(kubectl, account, "create", "--dry-run=server", "-f", "-", stdin=bad).stderr \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        yield state
    finally:
        kubectl.run("delete", "-f", "-", "--ignore-not-found", stdin=policy, check=False)
        kubectl.run("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


def rendered(state: dict[str, Any], name: str = "nvme-minimal") -> list[dict[str, Any]]:
    """The sample's StatefulSet and Deployment as the operator applies them: build_all, then the
    owner reference to the KVCacheNamespace (kvpersist.controller.apply)."""
    owner = state["owners"][name]
    out = [m for m in build_all(target_of(owner)) if m["kind"] in ("StatefulSet", "Deployment")]
    for m in out:
        kopf.append_owner_reference(m, owner=owner)
    return out


def refused_object(state: dict[str, Any], case: str) -> dict[str, Any]:
    sts = next(m for m in rendered(state) if m["kind"] == "StatefulSet")
    REFUSED[case][2](sts)
    return sts


def test_what_the_operator_renders_is_admitted_from_its_account(kubectl: Kubectl, bounded: dict[str, Any]) -> None:
    """Each sample's StatefulSet and Deployment (server-side dry run), then one created for real by
    server-side apply, as the operator does, and applied again changed: an update it may make."""
    ns, account = bounded["ns"], bounded["account"]
    for name in SAMPLES:
        for m in rendered(bounded, name):
            out = as_operator(kubectl, account, "create", "--dry-run=server", "-f", "-", stdin=json.dumps(m))
            assert out.returncode == 0, (name, m["kind"], out.stderr)
    sts = next(m for m in rendered(bounded, "tp2-fp8") if m["kind"] == "StatefulSet")  # not a name the others use
    sts["spec"]["replicas"] = 0  # as the operator renders it with the cache off: no pod to schedule here
    apply = ("apply", "--server-side", "--field-manager=kvpersist", "--force-conflicts", "-f", "-")
    out = as_operator(kubectl, account, *apply, stdin=json.dumps(sts))
    assert out.returncode == 0, out.stderr
    sts["spec"]["template"]["metadata"]["annotations"] = {"kvpersist.dev/agent-rolled": "1"}
    out = as_operator(kubectl, account, *apply, stdin=json.dumps(sts))
    assert out.returncode == 0, out.stderr
    live = kubectl.get("statefulset", sts["metadata"]["name"], ns)
    assert live["spec"]["template"]["metadata"]["annotations"] == {"kvpersist.dev/agent-rolled": "1"}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_kvpersist_never_renders_is_refused_naming_the_reason(kubectl: Kubectl, bounded: dict[str, Any], case: str) -> None:
    """From the operator's account: refused by the policy, with the object and the reason named.
    From the cluster admin the same object is admitted: the policy bounds that one account only."""
    obj = json.dumps(refused_object(bounded, case))
    out = as_operator(kubectl, bounded["account"], "create", "--dry-run=server", "-f", "-", stdin=obj)
    err = out.stderr
    assert out.returncode != 0 and f"ValidatingAdmissionPolicy '{POLICY}'" in err, err
    assert f"StatefulSet {bounded['ns']}/llama31-8b-lmcache:" in err and REFUSED[case][1] in err, err
    admin = kubectl.run("create", "--dry-run=server", "-f", "-", stdin=obj, check=False)
    assert admin.returncode == 0, admin.stderr


def test_a_workload_someone_else_made_is_never_taken_over(kubectl: Kubectl, bounded: dict[str, Any]) -> None:
    """A Deployment the admin made under the name the operator derives, even with the operator's
    labels: the operator's apply over it is refused (an update of an object no KVCacheNamespace
    controlled), and it stays theirs."""
    ns, account = bounded["ns"], bounded["account"]
    deployment = next(m for m in rendered(bounded) if m["kind"] == "Deployment")
    name = deployment["metadata"]["name"]
    theirs = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": name, "namespace": ns, "labels": deployment["metadata"]["labels"]},
              "spec": {"replicas": 0, "selector": deployment["spec"]["selector"],
                       "template": {"metadata": {"labels": deployment["spec"]["template"]["metadata"]["labels"]},
                                    "spec": {"containers": [{"name": "web", "image": "registry.example.com/theirs/web:v1"}]}}}}
    kubectl.apply(theirs)
    deployment["spec"]["replicas"] = 0
    out = as_operator(kubectl, account, "apply", "--server-side", "--field-manager=kvpersist", "--force-conflicts", "-f", "-",
                      stdin=json.dumps(deployment))
    err = out.stderr
    assert out.returncode != 0 and f"ValidatingAdmissionPolicy '{POLICY}'" in err, err
    assert f"Deployment {ns}/{name}:" in err and "it never takes over a workload it did not make" in err, err
    live = kubectl.get("deployment", name, ns)
    assert live["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/theirs/web:v1"
    assert not live["metadata"].get("ownerReferences")


def test_image_prefixes_are_matched_as_the_operator_matches_them(kubectl: Kubectl, bounded: dict[str, Any]) -> None:
    """The policy's CEL and the operator's own matcher (kvpersist.controller.policy.image_allowed)
    agree on every image here: the lmcache server's image swapped in the rendered StatefulSet."""
    admitted, expected = {}, {}
    for image in IMAGES:
        sts = next(m for m in rendered(bounded) if m["kind"] == "StatefulSet")
        sts["spec"]["template"]["spec"]["containers"][0]["image"] = image
        out = as_operator(kubectl, bounded["account"], "create", "--dry-run=server", "-f", "-", stdin=json.dumps(sts))
        assert out.returncode == 0 or POLICY in out.stderr, out.stderr
        admitted[image], expected[image] = out.returncode == 0, image_allowed(image, PREFIXES)
    assert admitted == expected, yaml.safe_dump({i: {"policy": admitted[i], "operator": expected[i]} for i in IMAGES
                                                 if admitted[i] != expected[i]})
    assert set(expected.values()) == {True, False}
