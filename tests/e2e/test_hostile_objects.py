"""Issue 58 item 1 on the real API server: ConfigMaps and Secrets of hostile metadata in a watched
namespace (1,500 labels and a 250 KiB annotation each, what anyone who may create one there can
write) are cached as what the operator reads of them and nothing more, listed in small pages.
The operator's RSS under thousands of them is measured by `benchmarks/reconcile_bench.py hostile`."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvpersist.controller import watchcache
from tests.e2e.kube import REPO, Kubectl

pytestmark = pytest.mark.e2e
# Run in a process of its own (the kube client's configuration is process-wide): the operator's
# Secret and ConfigMap watch caches over the namespace, each list request's page size recorded;
# prints what they hold once listed, then the object named "late" once its watch event came.
CACHES = r"""
import json, sys, time
from kvpersist.controller import kube, watchcache
kube.load_config(sys.argv[1])
ns = sys.argv[2]
limits = []
request = kube.client().request
def counted(*args, **kwargs):
    if not kwargs.get("watch"):
        limits.append(kwargs.get("limit"))
    return request(*args, **kwargs)
kube.client().request = counted
caches = {"ConfigMap": watchcache.configmaps((ns,)), "Secret": watchcache.secrets((ns,), ("usable",))}
for cache in caches.values():
    cache.start()
deadline = time.monotonic() + 60
while not all(c.lookup(ns, "-")[0] for c in caches.values()) and time.monotonic() < deadline:
    time.sleep(0.1)
print(json.dumps({"limits": limits, **{k: c.everything() for k, c in caches.items()}}), flush=True)
while caches["ConfigMap"].lookup(ns, "late")[1] is None and time.monotonic() < deadline + 60:
    time.sleep(0.1)
print(json.dumps(caches["ConfigMap"].lookup(ns, "late")[1]), flush=True)
"""


def hostile(kind: str, ns: str, name: str, **labels: str) -> dict[str, Any]:
    big = {f"k{i:04d}-{'x' * 50}": "v" * 63 for i in range(1500)}
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": ns, "labels": {**big, **labels},
                                                           "annotations": {"bulk": "a" * 250 * 1024}}}


def create(kubectl: Kubectl, objs: list[dict[str, Any]]) -> None:
    """create, not apply: kubectl's last-applied annotation would pass the 256 KiB limit."""
    kubectl.run("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}), timeout=120)


def test_others_configmaps_and_secrets_are_cached_as_what_is_read_of_them(kubectl: Kubectl, namespace: str) -> None:
    ns = namespace
    create(kubectl, [hostile("ConfigMap", ns, f"h{i}") for i in range(3)]
           + [hostile("Secret", ns, f"s{i}", usable="yes", **{"app.kubernetes.io/managed-by": "kvpersist"}) for i in range(3)]
           + [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"small{i:03d}", "namespace": ns}}
              for i in range(60)])
    proc = subprocess.Popen([sys.executable, "-c", CACHES, str(kubectl.kubeconfig), ns], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        listed = json.loads(proc.stdout.readline() or "null")
        assert listed is not None, proc.stderr.read() if proc.poll() is not None else "no listing"
        create(kubectl, [hostile("ConfigMap", ns, "late")])
        late = json.loads(proc.stdout.readline() or "null")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    # Each list came in small pages (66 ConfigMaps: 7 of 10), more than one raw page never held.
    assert listed["limits"] and set(listed["limits"]) == {watchcache.SMALL_PAGE}, listed["limits"]
    assert len(listed["limits"]) >= 66 // watchcache.SMALL_PAGE + 1  # the ConfigMaps' pages, and the Secrets'
    configmaps = {o["metadata"]["name"]: o for o in listed["ConfigMap"]}
    assert len(configmaps) >= 63 and {"h0", "h1", "h2", "small059"} <= set(configmaps)
    for obj in [*configmaps.values(), late]:  # listed, or come by a watch event: the same view
        assert set(obj) == {"metadata"} and set(obj["metadata"]) <= {"name", "namespace", "uid", "resourceVersion"}, obj
    secrets = {o["metadata"]["name"]: o for o in listed["Secret"] if o["metadata"]["name"].startswith("s")}
    assert set(secrets) == {"s0", "s1", "s2"}
    for obj in secrets.values():
        assert obj["metadata"]["labels"] == {"usable": "yes", "app.kubernetes.io/managed-by": "kvpersist"}
        assert obj["metadata"]["annotations"] == {}
    # What all of it takes as JSON: a few hundred bytes an object, where each came with over 400 KiB.
    assert len(json.dumps(listed)) < 200 * (len(configmaps) + len(listed["Secret"])) + 1024
