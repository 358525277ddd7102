"""Admin end to end: reports from the data itself, orphans after a pin change, and explicit
cleanup, with real lmcache servers writing real files and the inventory agent beside each.

In order: store KV in namespace A; `kvpersist plan` of a pin change names A -> B and A's bytes as
the operator's inventory measured them, and kubectl apply prints the pin-change policy's Warning
(config/pin-change-warning, installed for this module) with them; change the pin (namespace B) and
store there too; the plan of a rollback says A's data is on the volume; `report`
shows A as an orphan with the bytes `du` counts; `gc A` (dry run) changes nothing; `gc B` is
refused (in use); a user who may edit the resource but lacks kvcachenamespaces/gc is refused by
the API server (config/gc's policy, installed for this module); granted it, the request is
admitted, and the operator's fresh re-check refuses A, now used by a resource in a namespace it
does not watch; `gc A --no-dry-run` frees exactly A's bytes and leaves B byte-identical.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.inventory.volume import served_of
from kvpersist.status.usage import human_bytes
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, bench_store, key_of, kvpersist_env, manifest, target_of
from tests.fsstate import files_state

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]

LMCACHE = shutil.which("lmcache")


def kvns_status(k: Kubectl, ns: str) -> dict:
    return k.get("kvns", NAME, ns).get("status") or {}


def cli(k: Kubectl, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpersist.cli", *args, "--kubeconfig", str(k.kubeconfig)],
                          capture_output=True, text=True, timeout=240)


def _plan(k: Kubectl, obj: dict, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """`kvpersist plan -f` of obj, as its user runs it."""
    path = tmp / "planned.yaml"
    path.write_text(json.dumps(obj))
    return cli(k, "plan", "-f", str(path), *args)


def du_files(folder: Path) -> int:
    """What `du` counts for the files of a namespace folder (apparent bytes, the folder's own
    directory entry left out: gc removes that too, but it is not KV data)."""
    files = [str(p) for p in folder.rglob("*") if p.is_file()]
    out = subprocess.run(["du", "-cb", *files], capture_output=True, text=True, check=True, timeout=60).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def du_volume(volume: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(volume)], capture_output=True, text=True, check=True, timeout=60).stdout.split()[0])


@pytest.fixture(scope="module")
def scenario(kubectl: Kubectl, crd: None, gc_policy: None, pin_change_policy: None,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if LMCACHE is None:
        pytest.fail("lmcache not on PATH: run through hack/test.sh (installs the datapath extra)")
    with kvpersist_env(kubectl, tmp_path_factory.mktemp("admin")) as env:
        yield {"ns": env.ns, "volume": env.volume(), "tmp": tmp_path_factory.mktemp("plans")}


def _ready_with(kubectl: Kubectl, ns: str, namespace_id: str | None) -> dict:
    return wait_for(f"Ready on {namespace_id}", lambda: (lambda s: s if s.get("phase") == "Ready" and s.get("namespaceId")
                                                         == namespace_id else None)(kvns_status(kubectl, ns)), timeout=240)


def test_pin_change_leaves_an_orphan_that_report_counts_like_du(kubectl: Kubectl, scenario: dict) -> None:
    ns, volume = scenario["ns"], scenario["volume"]
    old = manifest(ns)
    kubectl.apply(old)
    a = target_of(old, kubectl).namespace_id
    _ready_with(kubectl, ns, a)
    bench_store(kubectl.get("pod", f"{NAME}-lmcache-0", ns)["status"]["podIP"], 0, 4)
    new = manifest(ns, maxModelLen=16384)
    b = target_of(new, kubectl).namespace_id
    assert a != b
    # Before the change (issue 32, item 2), with what the operator measured on the real volume:
    # `kvpersist plan` names both ids and what becomes an orphan; kubectl apply prints the
    # pin-change policy's Warning with the same numbers.
    # status.usage: the larger of the servers' count and the volume's; the plan and the warning read it.
    a_held = wait_for("the inventory to count what was stored", lambda: (lambda s: s["usage"] if (served_of(
        s.get("inventory"), a) or (None,))[0] == du_files(volume / a) and s.get("usage") else None)(kvns_status(kubectl, ns)),
        timeout=120, interval=1)
    assert a_held["l2UsedBytes"] >= du_files(volume / a)
    before = _plan(kubectl, new, scenario["tmp"])
    assert before.returncode == 2, before.stdout + before.stderr
    [plan] = json.loads(_plan(kubectl, new, scenario["tmp"], "-o", "json").stdout)
    assert (plan["oldId"], plan["newId"], plan["changedFields"]) == (a, b, ["spec.identity.maxModelLen"])
    assert plan["oldHeld"] == {"bytes": a_held["l2UsedBytes"], "objects": a_held["l2Objects"]}
    assert not (plan["newHeld"] or {}).get("bytes"), plan  # nothing of b yet: it starts cold
    applied = kubectl.apply(new)
    warning = [line for line in applied.stderr.splitlines() if line.startswith("Warning:")]
    assert warning and a in warning[0] and "spec.identity.maxModelLen" in warning[0], applied.stderr
    assert human_bytes(a_held["l2UsedBytes"]) in warning[0] and "kvpersist gc" in warning[0], warning
    _ready_with(kubectl, ns, b)
    bench_store(kubectl.get("pod", f"{NAME}-lmcache-0", ns)["status"]["podIP"], 0, 2)
    scenario.update(a=a, b=b)
    a_bytes = du_files(volume / a)
    assert a_bytes > 0 and du_files(volume / b) > 0

    def reported() -> list[dict] | None:
        out = cli(kubectl, "report", "-n", ns, "-o", "json")
        assert out.returncode == 0, out.stderr
        rows = {r["namespace_id"]: r for r in json.loads(out.stdout)}
        return list(rows.values()) if a in rows and b in rows and rows[a]["bytes"] == a_bytes and rows[b]["objects"] > 0 else None

    rows = wait_for("report to list both namespaces", reported, timeout=120)
    # Back to the old pins: the plan says a's data is on this resource's L2, a rollback served at once.
    [back] = json.loads(_plan(kubectl, old, scenario["tmp"], "-o", "json").stdout)
    assert (back["oldId"], back["newId"]) == (b, a) and back["newHeld"]["bytes"] == a_bytes, back
    assert rows[0]["namespace_id"] == a and rows[0]["orphan"] and rows[0]["bytes"] == a_bytes  # the first to delete
    assert rows[0]["objects"] == len(list((volume / a).iterdir()))
    assert not rows[1]["orphan"] and rows[1]["current"]
    inventory = kvns_status(kubectl, ns)["inventory"]
    assert (inventory["orphanedNamespaces"], inventory["orphanedBytes"]) == (1, a_bytes)
    table = cli(kubectl, "report", "-n", ns)
    assert table.returncode == 0 and f"kvpersist gc {a} --no-dry-run" in table.stdout, table.stdout
    status_table = cli(kubectl, "status", "-n", ns)
    assert NAME in status_table.stdout and "Ready" in status_table.stdout and "1 (" in status_table.stdout
    # The same as a kubectl plugin: kubectl finds kubectl-kvpersist on PATH; the kubeconfig comes from $KUBECONFIG.
    plugin = subprocess.run([str(kubectl.binary), "kvpersist", "report", "-n", ns], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KUBECONFIG": str(kubectl.kubeconfig),
                                 "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"})
    assert plugin.returncode == 0 and a in plugin.stdout, plugin.stdout + plugin.stderr


def test_gc_dry_run_changes_nothing_and_live_is_refused(kubectl: Kubectl, scenario: dict) -> None:
    ns, volume, a, b = scenario["ns"], scenario["volume"], scenario["a"], scenario["b"]
    before = {nsid: files_state(volume / nsid) for nsid in (a, b)}
    dry = cli(kubectl, "gc", a, "-n", ns)
    assert dry.returncode == 0 and "would delete" in dry.stdout and "nothing deleted" in dry.stdout, dry.stdout + dry.stderr
    live = cli(kubectl, "gc", b, "-n", ns, "--no-dry-run")
    assert live.returncode == 3 and "refused" in live.stderr and f"KVCacheNamespace {ns}/{NAME}" in live.stderr
    bad = cli(kubectl, "gc", "kvp-nothex", "-n", ns, "--no-dry-run")
    assert bad.returncode == 2
    assert {nsid: files_state(volume / nsid) for nsid in (a, b)} == before
    assert "gc" not in kvns_status(kubectl, ns)  # nothing reached the operator


def test_the_agent_refuses_anyone_without_the_resources_token(kubectl: Kubectl, scenario: dict) -> None:
    """The inventory agent on the server pod's IP, asked directly (this test process stands in for
    another pod: the local cluster enforces no NetworkPolicy, so only the token stands between):
    without the token, or with a wrong one, /gc deletes nothing and /inventory lists nothing."""
    from kvpersist.inventory.agentclient import fetch_inventory, request_gc

    ns, volume, a = scenario["ns"], scenario["volume"], scenario["a"]
    ip = kubectl.get("pod", f"{NAME}-lmcache-0", ns)["status"]["podIP"]
    before = files_state(volume / a)
    for token in (None, "0" * 64):
        code, body = request_gc(ip, 8090, a, dry_run=False, timeout=10, token=token)
        assert code == 401 and "token" in body["error"], (code, body)
        assert fetch_inventory(ip, 8090, token=token) is None
    assert files_state(volume / a) == before
    secret = kubectl.get("secret", f"{NAME}-agent-token", ns)
    assert secret["metadata"]["ownerReferences"][0]["name"] == NAME  # the resource's own: gone with it
    token = base64.b64decode(secret["data"]["token"]).decode()
    inv = fetch_inventory(ip, 8090, token=token)
    assert inv is not None and a in {n.namespace_id for n in inv.namespaces}


def test_gc_is_its_own_permission_and_in_use_is_checked_again_right_before_deleting(
        kubectl: Kubectl, scenario: dict, tmp_path: Path) -> None:
    """An editor (get, list, patch on kvcachenamespaces; list on pods) may edit the resource but not
    ask for gc: the API server refuses the annotation, naming the permission, and nothing is
    deleted. Bound to the ClusterRole kvpersist-gc, the same request is admitted; a resource in a
    namespace the operator does not watch resolves to A meanwhile (the editor's CLI cannot see it,
    nor can the operator's watch caches), and the operator's listing right before the agent's /gc
    refuses. A is untouched throughout."""
    ns, volume, a = scenario["ns"], scenario["volume"], scenario["a"]
    before = files_state(volume / a)
    kubectl.run("create", "serviceaccount", "kv-editor", "-n", ns)
    kubectl.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "kvns-editor", "namespace": ns},
                   "rules": [{"apiGroups": ["kvpersist.dev"], "resources": ["kvcachenamespaces"],
                              "verbs": ["get", "list", "watch", "patch", "update"]},
                             {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]})
    kubectl.run("create", "rolebinding", "kvns-editor", "--role=kvns-editor", f"--serviceaccount={ns}:kv-editor", "-n", ns)
    editor = kubectl.as_service_account(ns, "kv-editor", tmp_path / "editor.kubeconfig")
    user = f"system:serviceaccount:{ns}:kv-editor"
    request = json.dumps({"requestId": "by-hand", "namespaceId": a})
    annotate = ("annotate", "kvns", NAME, "-n", ns, f"kvpersist.dev/gc-request={request}")

    # Editing is allowed (another annotation), asking for gc is not: a server-side dry run first, so
    # that nothing is written should the policy not be loaded yet.
    editor.run("annotate", "kvns", NAME, "-n", ns, "example.com/owner=ml-team", "--overwrite")
    refused = wait_for("the API server to refuse the gc annotation", lambda: (lambda out: out if out.returncode else None)(
        editor.run(*annotate, "--dry-run=server", check=False)), timeout=60)
    for out in (refused, editor.run(*annotate, check=False)):
        assert out.returncode != 0 and "forbidden" in out.stderr.lower(), out.stderr
        assert "kvcachenamespaces/gc" in out.stderr and "ClusterRole kvpersist-gc" in out.stderr and user in out.stderr, out.stderr
    out = cli(editor, "gc", a, "-n", ns, "--no-dry-run")
    assert out.returncode == 4 and "not allowed to request gc" in out.stderr and "kvcachenamespaces/gc" in out.stderr, (
        out.stdout + out.stderr)
    assert "kvpersist.dev/gc-request" not in (kubectl.get("kvns", NAME, ns)["metadata"].get("annotations") or {})
    assert "gc" not in kvns_status(kubectl, ns) and files_state(volume / a) == before

    # Granted the gc step: admitted. Meanwhile A comes into use where neither the editor's CLI
    # (no cluster-wide list) nor the operator's caches (it watches ns only) look.
    kubectl.run("create", "rolebinding", "kvpersist-gc", "--clusterrole=kvpersist-gc", f"--serviceaccount={ns}:kv-editor",
                "-n", ns)
    wait_for("the grant to take effect", lambda: editor.run(*annotate, "--dry-run=server", check=False).returncode == 0, timeout=60)
    other = f"{ns}-other"
    kubectl.run("create", "namespace", other)
    # The same pins and the same L2 key (a Secret of its own with A's bytes, as clusters sharing a key
    # have): A's id, which only reading that Secret can tell (its status is empty: nothing serves it).
    key = key_of(kubectl, manifest(ns))
    kubectl.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "shared-key", "namespace": other},
                   "type": "Opaque", "data": {"master-key": base64.b64encode(key).decode()}})
    user_of_a = manifest(other)
    user_of_a["spec"]["l2"]["encryption"] = {"keySecretRef": {"name": "shared-key"}}
    assert target_of(user_of_a, kubectl).namespace_id == a
    kubectl.apply(user_of_a)
    try:
        out = cli(editor, "gc", a, "-n", ns, "--no-dry-run")
        assert out.returncode == 1 and f"{ns}/{NAME}: Refused" in out.stdout, out.stdout + out.stderr
        assert f"KVCacheNamespace {other}/{NAME}" in out.stdout and "checked again right before deleting" in out.stdout, out.stdout
        gc = kvns_status(kubectl, ns)["gc"]
        assert (gc["outcome"], gc["namespaceId"], gc["bytes"]) == ("Refused", a, 0)
        assert files_state(volume / a) == before
        assert "kvpersist.dev/gc-request" not in (kubectl.get("kvns", NAME, ns)["metadata"].get("annotations") or {})
    finally:
        kubectl.run("delete", "kvns", NAME, "-n", other, "--wait=true", "--timeout=60s", check=False)
        kubectl.run("delete", "namespace", other, "--wait=false", check=False)


def test_gc_frees_exactly_the_orphan_and_leaves_the_rest_identical(kubectl: Kubectl, scenario: dict) -> None:
    ns, volume, a, b = scenario["ns"], scenario["volume"], scenario["a"], scenario["b"]
    a_bytes, a_objects = du_files(volume / a), len(list((volume / a).iterdir()))
    dir_entry = du_volume(volume / a) - a_bytes  # the folder's own size, as du counts it
    b_before = files_state(volume / b)
    volume_before = du_volume(volume)
    out = cli(kubectl, "gc", a, "-n", ns, "--no-dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{ns}/{NAME}: Deleted" in out.stdout
    assert not (volume / a).exists()
    assert volume_before - du_volume(volume) == a_bytes + dir_entry
    assert files_state(volume / b) == b_before
    gc = kvns_status(kubectl, ns)["gc"]
    assert (gc["outcome"], gc["namespaceId"], gc["bytes"], gc["objects"]) == ("Deleted", a, a_bytes, a_objects)
    assert "kvpersist.dev/gc-request" not in (kubectl.get("kvns", NAME, ns)["metadata"].get("annotations") or {})
    events = json.loads(kubectl.run("get", "events", "-n", ns, "--field-selector", "reason=NamespaceDeleted", "-o",
                                    "json").stdout)["items"]
    assert any(a in e["message"] for e in events)
    wait_for("the report to drop the deleted namespace", lambda: a not in cli(kubectl, "report", "-n", ns).stdout, timeout=120)
    again = cli(kubectl, "gc", a, "-n", ns, "--no-dry-run")
    assert again.returncode == 1 and "no data" in again.stderr
