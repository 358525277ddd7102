"""Every builder, without a cluster: what one KVCacheNamespace becomes."""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest

from kvpersist.api.convert import gib_quantity
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.all import build_all
from kvpersist.builders.lmcache import (
    build_lmcache_statefulset,
    build_local_service,
    l2_adapter_config,
    l2_serde,
    server_args,
    server_resources,
)
from kvpersist.builders.retained import build_agent_token_secret, build_key_secret
from kvpersist.builders.target import (
    HF_TOKEN_ENV,
    L2_KEY_BYTES,
    L2_KEY_FILE,
    L2_KEY_MOUNT_PATH,
    L2_KEY_VOLUME,
    L2_MOUNT_PATH,
    NAMESPACE_ID_LABEL,
    Target,
)
from kvpersist.builders.vllm import build_vllm_deployment, kv_transfer_config, vllm_args
from kvpersist.identity import CHECKED_SERDE, key_fingerprint, resolve
from kvpersist.inserver import program_source
from kvpersist.inserver.serve import CHECKED_TYPE
from tests.cases.invalid_manifests import sample

KEY_FINGERPRINT = key_fingerprint(b"k" * 32)  # the L2 key's pin, as the operator reads it from the Secret


def target(name: str = "nvme-minimal", mutate=None, namespace: str = "ml") -> Target:
    obj = sample(name)
    if mutate:
        mutate(obj)
    model = KVCacheNamespace.model_validate(obj)
    return Target(obj["metadata"]["name"], namespace, model.spec, resolve(model.spec.pins(KEY_FINGERPRINT)).namespace_id,
                  key_fingerprint=KEY_FINGERPRINT if model.spec.l2.encryption.enabled else None)


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_server_args_carry_l1_eviction_and_safety_flags() -> None:
    t = target("tp2-fp8")
    args = server_args(t)
    assert args[0] == "server"
    # ZMQ on every interface (vLLM pods reach it); the admin API (/env, /cache/clear) on loopback only.
    assert _flag(args, "--host") == "0.0.0.0" and _flag(args, "--http-host") == "127.0.0.1"
    assert _flag(args, "--port") == "5555" and _flag(args, "--http-port") == "5556"
    assert _flag(args, "--l1-size-gb") == "64"
    assert _flag(args, "--eviction-policy") == "LRU"
    assert json.loads(_flag(args, "--l2-adapter"))["eviction"]["eviction_policy"] == "LRU"
    assert _flag(args, "--eviction-trigger-watermark") == "0.9" and _flag(args, "--eviction-ratio") == "0.1"
    assert "--no-run-script-api-enabled" in args
    assert json.loads(_flag(args, "--l2-adapter")) == l2_adapter_config(t)


def test_fs_native_is_the_default_with_io_threads_from_the_cpu_request() -> None:
    """fs_native (lmcache's C++ adapter): a whole chunk file per read, one per I/O thread, so the
    threads are the reads in flight: 4 per core of the server's CPU request (bounded), as the
    serde's workers follow it."""
    t = target()
    cfg = l2_adapter_config(t)
    assert cfg["type"] == "fs_native" and cfg["base_path"] == f"{L2_MOUNT_PATH}/{t.namespace_id}"
    assert (cfg["use_odirect"], cfg["persist_enabled"], cfg["num_workers"]) == (True, True, 8)  # 2 cores by default
    # the capacity less the 1/64 a frame's 4 KiB page can take on disk (chunks of 252 KiB or more)
    assert cfg["max_capacity_gb"] == pytest.approx(450 * 63 / 64)
    assert cfg["eviction"] == {"eviction_policy": "LRU", "trigger_watermark": 0.9, "eviction_ratio": 0.1}
    assert (l2_serde(t) or {}).get("max_workers") == 2
    for cpu, workers in (("500m", 4), ("16", 64), ("64", 128)):
        big = target(mutate=lambda o, c=cpu: o["spec"].setdefault("lmcacheServer", {}).update(
            resources={"requests": {"cpu": c}}))
        assert l2_adapter_config(big)["num_workers"] == workers


def test_the_server_sends_lmcache_no_usage_telemetry() -> None:
    container = build_lmcache_statefulset(target())["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LMCACHE_TRACK_USAGE"] == "false" and env["DO_NOT_TRACK"] == "1"


def test_nixl_adapter_is_persistent_capped_and_namespaced() -> None:
    t = target(mutate=lambda o: o["spec"]["l2"]["nvme"].update(adapter="nixl_store_dynamic"))
    cfg = l2_adapter_config(t)
    assert cfg["type"] == "nixl_store_dynamic" and cfg["backend"] == "POSIX" and cfg["persist_enabled"] is True
    assert cfg["backend_params"] == {"file_path": f"{L2_MOUNT_PATH}/{t.namespace_id}", "use_direct_io": "true",
                                     "max_capacity_gb": repr(450 * 16 / 17)}  # the share the disk padding leaves:
    # encrypted, a file is its chunk and one L1 page, at most a sixteenth of a layer (64 KiB of 1 MiB here)
    assert cfg["eviction"] == {"eviction_policy": "LRU", "trigger_watermark": 0.9, "eviction_ratio": 0.1}


def test_fs_adapter() -> None:
    t = target(mutate=lambda o: o["spec"]["l2"]["nvme"].update(adapter="fs"))  # directIO true by default
    cfg = l2_adapter_config(t)
    assert cfg["type"] == "fs" and cfg["base_path"].endswith(t.namespace_id) and cfg["use_odirect"] is True


def test_hfbucket_adapter_uses_token_env_and_namespaced_prefix() -> None:
    t = target("hf-bucket")
    cfg = l2_adapter_config(t)
    assert cfg["type"] == "hfbucket" and cfg["shared"] is True
    assert cfg["bucket_handle"] == f"hf://buckets/acme-ml/kv-cache/prod/{t.namespace_id}"
    assert cfg["token_env"] == HF_TOKEN_ENV and "token" not in cfg
    # createBucketIfMissing is true in this spec, yet lmcache never creates it: its bucket would be public
    # (no visibility sent); the operator's preflight creates it private.
    assert (cfg["create_bucket_if_missing"], cfg["num_workers"], cfg["max_capacity_gb"]) == (False, 8, 2000)
    sts = build_lmcache_statefulset(t)
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env[HF_TOKEN_ENV] == {"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": "hf-kv-writer", "key": "token"}}}
    assert "volumeClaimTemplates" not in sts["spec"]


def test_two_resources_on_one_volume_get_disjoint_paths() -> None:
    a = target()
    b = target(mutate=lambda o: o["spec"]["identity"].update(maxModelLen=16384))
    assert a.namespace_id != b.namespace_id
    pa = l2_adapter_config(a)["base_path"]
    pb = l2_adapter_config(b)["base_path"]
    assert pa != pb and not pa.startswith(pb) and not pb.startswith(pa)


@pytest.mark.parametrize(("l1", "request_mi", "limit_mi"), [(32, 37 * 1024, 56832), (0.25, 5376, 8064)])
def test_server_memory_from_l1(l1: float, request_mi: int, limit_mi: int) -> None:
    t = target(mutate=lambda o: o["spec"]["l1"].update(size=gib_quantity(l1, "l1")))
    res = server_resources(t)
    assert res["requests"]["memory"] == f"{request_mi}Mi" and res["limits"]["memory"] == f"{limit_mi}Mi"


def test_server_memory_override() -> None:
    t = target(mutate=lambda o: o["spec"].update(lmcacheServer={"resources": {"limits": {"memory": "100Gi"}}}))
    assert server_resources(t)["limits"]["memory"] == "100Gi"


def test_statefulset_claims_outlive_pods_and_follow_reclaim_policy() -> None:
    sts = build_lmcache_statefulset(target())
    spec = sts["spec"]
    assert spec["replicas"] == 1 and spec["serviceName"] == "llama31-8b-lmcache-metrics"
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    vct = spec["volumeClaimTemplates"][0]
    assert vct["spec"]["storageClassName"] == "local-nvme" and vct["spec"]["resources"]["requests"]["storage"] == "500Gi"
    pod = spec["template"]["spec"]
    assert not {"hostIPC", "hostPID", "hostNetwork"} & set(pod) and pod["runtimeClassName"] == "nvidia"
    container = pod["containers"][0]
    # lmcache, in a shell that makes what it writes group-writable (the non-root agent deletes it)
    # and checks the installed lmcache against connectorBuild first (kvpersist.builders.buildcheck),
    # run by the image's python3 through kvpersist.inserver.serve (kvpersist's L2 serde, then lmcache).
    assert container["command"] == ["sh", "-c", 'umask 0002 && python3 -c "$KVPERSIST_BUILD_CHECK" && '
                                    'exec "$0" -c "$KVPERSIST_LMCACHE_SERVE" "$@"', "python3"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVPERSIST_LMCACHE_SERVE"] == program_source() and "lmcache.cli.main" in env["KVPERSIST_LMCACHE_SERVE"]
    assert container["volumeMounts"][0] == {"name": "l2", "mountPath": L2_MOUNT_PATH}
    # Nothing listens on the pod IP but ZMQ: the probes run inside the container, on loopback.
    assert [p["name"] for p in container["ports"]] == ["zmq"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "httpGet" not in container[probe]
        assert container[probe]["exec"]["command"][:2] == ["python3", "-c"]
        assert container[probe]["exec"]["command"][-1] == "http://127.0.0.1:5556/healthcheck"
    deleting = build_lmcache_statefulset(target(mutate=lambda o: o["spec"]["l2"]["nvme"].update(reclaimPolicy="Delete")))
    assert deleting["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"


def test_existing_claim_is_mounted_not_templated() -> None:
    t = target(mutate=lambda o: o["spec"]["l2"].update(nvme={"existingClaimName": "kv-data", "maxCapacity": "100Gi"}))
    sts = build_lmcache_statefulset(t)
    assert "volumeClaimTemplates" not in sts["spec"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["l2"] == {"name": "l2", "persistentVolumeClaim": {"claimName": "kv-data"}}


def test_services() -> None:
    t = target()
    local = build_local_service(t)
    assert local["metadata"]["name"] == f"llama31-8b-lmcache-{t.namespace_id[4:12]}"
    assert local["spec"]["internalTrafficPolicy"] == "Local"
    assert local["spec"]["ports"] == [{"name": "zmq", "port": 5555, "targetPort": "zmq", "protocol": "TCP"}]
    # The local Service selects only servers of the current namespace id.
    servers = build_lmcache_statefulset(t)["spec"]["selector"]["matchLabels"]
    assert local["spec"]["selector"] == {**servers, NAMESPACE_ID_LABEL: t.namespace_id}
    # No other Service in front of the servers: the StatefulSet keeps the serviceName earlier versions gave it
    # (immutable), which no Service holds; an earlier version's own is deleted (decision.RETIRED).
    assert [m["metadata"]["name"] for m in build_all(t) if m["kind"] == "Service"] == [local["metadata"]["name"]]
    assert build_lmcache_statefulset(t)["spec"]["serviceName"] == "llama31-8b-lmcache-metrics"


def test_a_vllm_pod_can_only_reach_servers_of_its_own_namespace_id() -> None:
    """Name, selector, affinity, policy and connection all carry the id: a pin change gives new
    ones, and the old vLLM pods keep theirs, which select no server of the new identity."""
    from kvpersist.builders.lmcache import build_network_policy

    old, new = target(), target(mutate=lambda o: o["spec"]["identity"].update(maxModelLen=4096))
    assert old.namespace_id != new.namespace_id
    for t in (old, new):
        server_labels = build_lmcache_statefulset(t)["spec"]["template"]["metadata"]["labels"]
        vllm_pod = build_vllm_deployment(t)["spec"]["template"]
        host = json.loads(_flag(vllm_pod["spec"]["containers"][0]["args"], "--kv-transfer-config"))[
            "kv_connector_extra_config"]["lmcache.mp.host"]
        assert host == f"tcp://{build_local_service(t)['metadata']['name']}.ml.svc.cluster.local."
        affinity = vllm_pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        policy = build_network_policy(t, "kvpersist-system")
        zmq = policy["spec"]["ingress"][-1]
        assert zmq["ports"] == [{"protocol": "TCP", "port": 5555}]
        for other in (old, new):
            other_server = build_lmcache_statefulset(other)["spec"]["template"]["metadata"]["labels"]
            other_vllm = build_vllm_deployment(other)["spec"]["template"]["metadata"]["labels"]
            same = other is t

            def selects(selector: dict, labels: dict) -> bool:
                return all(labels.get(k) == v for k, v in selector.items())

            assert selects(build_local_service(t)["spec"]["selector"], other_server) == same
            assert selects(affinity["labelSelector"]["matchLabels"], other_server) == same
            assert selects(policy["spec"]["podSelector"]["matchLabels"], other_server) == same
            assert selects(zmq["from"][0]["podSelector"]["matchLabels"], other_vllm) == same
        assert selects(build_local_service(t)["spec"]["selector"], server_labels)
    assert build_local_service(old)["metadata"]["name"] != build_local_service(new)["metadata"]["name"]
    assert build_network_policy(old, None)["metadata"]["name"] == build_local_service(old)["metadata"]["name"]
    assert build_network_policy(old, None)["metadata"]["name"] != build_network_policy(new, None)["metadata"]["name"]


def test_nothing_but_the_vllm_pods_carries_the_connection() -> None:
    """A client launched from a published kv-transfer-config carries none of the pins (any model,
    any flags) and would write its KV into the namespace that pinned vLLM pods read: no object but
    the vLLM Deployment holds it (the namespace id is in status.namespaceId; no ConfigMap)."""
    objs = build_all(target())
    assert "ConfigMap" not in {o["kind"] for o in objs}
    assert all("kv_connector" not in json.dumps(o) for o in objs if o["kind"] != "Deployment")


def test_vllm_kv_transfer_config_pins_the_connector_module() -> None:
    t = target()
    cfg = json.loads(_flag(vllm_args(t), "--kv-transfer-config"))
    assert cfg == kv_transfer_config(t)
    assert cfg["kv_connector"] == "LMCacheMPConnector"
    assert cfg["kv_connector_module_path"] == "lmcache.integration.vllm.lmcache_mp_connector"
    assert cfg["kv_role"] == "kv_both"
    assert cfg["kv_connector_extra_config"] == {"lmcache.mp.host": f"tcp://llama31-8b-lmcache-{t.namespace_id[4:12]}.ml.svc.cluster.local.",
                                                "lmcache.mp.port": 5555,
                                                "lmcache.mp.heartbeat_interval": 2.0,
                                                "lmcache.mp.isolated_ipc": True}


def test_vllm_launch_has_exactly_the_pins() -> None:
    t = target("tp2-fp8")
    args = vllm_args(t)
    ident = t.spec.identity
    assert args[:2] == ["serve", ident.model_id]
    assert _flag(args, "--revision") == ident.model_revision
    assert _flag(args, "--tokenizer") == ident.resolved()["tokenizer"] == ident.model_id  # the default: the model's
    assert _flag(args, "--tokenizer-revision") == ident.resolved()["tokenizer_revision"] == ident.model_revision
    assert _flag(args, "--kv-cache-dtype") == "fp8_e4m3"
    assert _flag(args, "--block-size") == "16"
    assert _flag(args, "--tensor-parallel-size") == "2"
    assert _flag(args, "--max-model-len") == "65536"
    assert json.loads(_flag(args, "--kv-transfer-config")) == kv_transfer_config(t)
    assert args[-3:] == ["--gpu-memory-utilization", "0.90", "--enable-prefix-caching"]


def test_vllm_deployment_co_located_with_its_server() -> None:
    t = target("tp2-fp8")
    dep = build_vllm_deployment(t)
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert {"name": "PYTHONHASHSEED", "value": "0"} in container["env"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert not {"hostIPC", "hostPID", "hostNetwork"} & set(pod) and pod["runtimeClassName"] == "nvidia"
    term = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == {**build_lmcache_statefulset(t)["spec"]["selector"]["matchLabels"],
                                                    NAMESPACE_ID_LABEL: t.namespace_id}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert dep["spec"]["replicas"] == 2


def test_incomplete_identity_runs_vllm_without_cache() -> None:
    t = target(mutate=lambda o: o["spec"]["identity"].pop("chatTemplateDigest"))
    assert t.namespace_id is None
    args = vllm_args(t)
    assert "--kv-transfer-config" not in args and _flag(args, "--kv-cache-dtype") == "bfloat16"
    pod = build_vllm_deployment(t)["spec"]["template"]["spec"]
    assert "affinity" not in pod and "hostIPC" not in pod
    assert build_lmcache_statefulset(t)["spec"]["replicas"] == 0  # scaled down, claims kept
    # Every server's policy (none runs): the agent's port, no ZMQ, under the name of no namespace id.
    from kvpersist.builders.lmcache import build_network_policy

    policy = build_network_policy(t, "kvpersist-system")
    assert policy["metadata"]["name"] == "llama31-8b-lmcache" and [r["ports"] for r in policy["spec"]["ingress"]] == [
        [{"protocol": "TCP", "port": 8090}]]
    assert policy["spec"]["podSelector"]["matchLabels"] == build_lmcache_statefulset(t)["spec"]["selector"]["matchLabels"]


def test_namespace_id_labels_and_owned_names() -> None:
    t = target()
    objs = build_all(t)
    assert [o["kind"] for o in objs] == ["NetworkPolicy", "StatefulSet", "Service", "Deployment"]  # one server: no budget
    for o in objs:
        assert o["metadata"]["namespace"] == "ml"
        assert o["metadata"]["labels"]["kvpersist.dev/namespace-id"] == t.namespace_id
        assert o["metadata"]["name"].startswith("llama31-8b-")


def test_network_policy_admits_only_operator_to_admin_port() -> None:
    from kvpersist.builders.lmcache import OPERATOR_LABELS, build_network_policy

    t = target()
    pol = build_network_policy(t, "kvpersist-system")
    assert pol["spec"]["podSelector"]["matchLabels"] == {**build_lmcache_statefulset(t)["spec"]["selector"]["matchLabels"],
                                                         NAMESPACE_ID_LABEL: t.namespace_id}
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    [http, zmq] = pol["spec"]["ingress"]
    assert zmq["ports"] == [{"protocol": "TCP", "port": 5555}]
    assert zmq["from"] == [{"podSelector": {"matchLabels": {
        **build_vllm_deployment(t)["spec"]["selector"]["matchLabels"], NAMESPACE_ID_LABEL: t.namespace_id}}}]
    assert http["ports"] == [{"protocol": "TCP", "port": 8090}]  # the agent (lmcache's admin API is loopback only)
    assert http["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvpersist-system"}},
                             "podSelector": {"matchLabels": OPERATOR_LABELS}}]
    closed = build_network_policy(t, None)
    assert closed["spec"]["ingress"] == [zmq] and closed["spec"]["policyTypes"] == ["Ingress"]  # operator unknown: closed


def test_servers_keep_the_agent_rule_while_another_id_holds_the_route_name() -> None:
    """target.routes False (controller.stale_routes): the id's policy name is another id's, so no
    per-id policy; every server gets the agent rule under <name>-lmcache (labelled with no id: never
    taken for an earlier version's, controller.decision.RETIRED), and ZMQ stays closed."""
    from kvpersist.builders.lmcache import build_network_policy

    t = dataclasses.replace(target(), routes=False, cache_bypassed=True)
    [policy] = [o for o in build_all(t, "kvpersist-system") if o["kind"] == "NetworkPolicy"]
    assert policy == build_network_policy(t, "kvpersist-system")
    assert policy["metadata"]["name"] == "llama31-8b-lmcache" and NAMESPACE_ID_LABEL not in policy["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"] == build_lmcache_statefulset(t)["spec"]["selector"]["matchLabels"]
    assert [r["ports"] for r in policy["spec"]["ingress"]] == [[{"protocol": "TCP", "port": 8090}]]


def test_operator_metrics_text() -> None:
    """Counted against what the module already held: other tests (in any order) leave phases and
    counts behind in the process."""
    import urllib.request
    import uuid

    from kvpersist.controller import metrics

    def scrape() -> dict[str, float]:
        server = metrics.serve("127.0.0.1", 0)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=5) as r:
                text = r.read().decode()
        finally:
            server.shutdown()
        assert "# TYPE kvpersist_status_writes_total counter" in text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if not line.startswith("#")}

    ns = f"ml-{uuid.uuid4().hex[:6]}"
    before = scrape()
    metrics.inc("kvpersist_status_writes_total", 3)
    metrics.refreshed(ns, "a", "Ready")
    metrics.refreshed(ns, "a", "Ready")
    metrics.refreshed(ns, "b", "Ready")
    metrics.refreshed(ns, "c", "Degraded")
    metrics.set_phase(ns, "c", None)  # deleted: its phase and its series go
    after = scrape()
    assert after["kvpersist_status_writes_total"] == before["kvpersist_status_writes_total"] + 3
    assert after["kvpersist_status_refreshes_total"] == before["kvpersist_status_refreshes_total"] + 4
    ready, degraded = 'kvpersist_resources{phase="Ready"}', 'kvpersist_resources{phase="Degraded"}'
    assert after[ready] == before.get(ready, 0) + 2 and after.get(degraded, 0) == before.get(degraded, 0)
    assert after[f'kvpersist_resource_refreshes_total{{name="a",namespace="{ns}"}}'] == 2  # labels sorted by name
    assert after[f'kvpersist_resource_refreshes_total{{name="b",namespace="{ns}"}}'] == 1
    assert not any(f'name="c",namespace="{ns}"' in key for key in after)


def test_budget_caps_the_adapter_and_turns_eviction_off() -> None:
    t = target(mutate=lambda o: o["spec"]["l2"]["nvme"].update(budget="2Mi", adapter="nixl_store_dynamic"))
    cfg = l2_adapter_config(t)
    # 2 MiB, as lmcache parses float(GB) * 2**30, less the 1/17 an encrypted object's page takes on disk
    assert float(cfg["backend_params"]["max_capacity_gb"]) * 2**30 == pytest.approx(2 * 2**20 * 16 / 17)
    plain = l2_adapter_config(target(mutate=lambda o: o["spec"]["l2"].update(
        nvme={**o["spec"]["l2"]["nvme"], "budget": "2Mi", "adapter": "nixl_store_dynamic"}, encryption={"enabled": False})))
    assert plain["backend_params"]["max_capacity_gb"] == cfg["backend_params"]["max_capacity_gb"]  # checked: framed too
    assert cfg["eviction"]["eviction_policy"] == "noop"
    assert "--eviction-policy" in server_args(t)  # L1 keeps the spec's policy
    assert server_args(t)[server_args(t).index("--eviction-policy") + 1] == t.spec.eviction.policy


def test_an_agent_beside_every_server_and_the_volume_only_with_nvme() -> None:
    t = dataclasses.replace(target(), agent_image="img:1")
    pod = build_lmcache_statefulset(t)["spec"]["template"]["spec"]
    server, agent = pod["containers"]
    assert agent["image"] == "img:1" and agent["command"] == ["kvpersist"]
    assert agent["args"][:1] == ["agent"] and _flag(agent["args"], "--serving") == t.namespace_id
    assert _flag(agent["args"], "--root") == L2_MOUNT_PATH and agent["volumeMounts"][0] == server["volumeMounts"][0]
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # It forwards the operator's reads of lmcache's loopback-only admin API.
    assert _flag(agent["args"], "--server-url") == "http://127.0.0.1:5556"
    bucket = build_lmcache_statefulset(target("hf-bucket"))["spec"]["template"]["spec"]
    server, agent = bucket["containers"]
    assert agent["name"] == "inventory-agent" and "--root" not in agent["args"] and "--serving" not in agent["args"]
    assert _flag(agent["args"], "--server-url") == "http://127.0.0.1:5556"
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # no volume: no capability
    assert [m["name"] for m in agent["volumeMounts"]] == ["agent-token"]


def test_stale_routes_are_old_ids_no_pod_carries() -> None:
    from kvpersist.controller.stale_routes import ids_in_use, stale

    old, new = target(), target(mutate=lambda o: o["spec"]["identity"].update(maxModelLen=4096))
    objs = [build_local_service(old), build_local_service(new),
            {"metadata": {"name": "llama31-8b-lmcache", "labels": {NAMESPACE_ID_LABEL: old.namespace_id}}}]
    old_pod = {"metadata": {"labels": build_vllm_deployment(old)["spec"]["template"]["metadata"]["labels"]}}
    new_pod = {"metadata": {"labels": build_vllm_deployment(new)["spec"]["template"]["metadata"]["labels"]}}
    # An old vLLM pod still runs: its Service stays.
    assert stale(new, objs, ids_in_use([old_pod, new_pod])) == []
    # It is gone: only the old id's per-id Service goes, never a name the resource keeps.
    assert stale(new, objs, ids_in_use([new_pod])) == [build_local_service(old)["metadata"]["name"]]
    assert stale(old, objs, ids_in_use([])) == [build_local_service(new)["metadata"]["name"]]


# ---------------------------------------------------------------- L2 encryption (spec.l2.encryption)


@pytest.mark.parametrize(("cpu", "workers"), [(None, 2), ("1", 1), ("500m", 1), ("1500m", 2), ("16", 16), ("1000", 64)])
def test_serde_workers_follow_the_servers_cpu_request(cpu: str | None, workers: int) -> None:
    """One serde thread per whole core the server pod requests (the default request is 2 cores)."""
    def with_cpu(obj: dict) -> None:
        if cpu is not None:
            obj["spec"].setdefault("lmcacheServer", {})["resources"] = {"requests": {"cpu": cpu}}

    t = target(mutate=with_cpu)
    assert l2_adapter_config(t)["serde"]["max_workers"] == workers
    requests = build_lmcache_statefulset(t)["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests["cpu"] == (cpu or "2")


@pytest.mark.parametrize("name", ["nvme-minimal", "hf-bucket"])
def test_l2_is_encrypted_by_default_with_the_key_as_a_file(name: str) -> None:
    t = target(name)
    cfg = l2_adapter_config(t)
    assert cfg["serde"] == {"type": "kvpersist-aesgcm", "aes_bits": 256, "max_workers": 2,
                            "master_key_path": f"{L2_KEY_MOUNT_PATH}/{L2_KEY_FILE}",
                            "key_fingerprint": KEY_FINGERPRINT, "namespace_id": t.namespace_id}
    pod = build_lmcache_statefulset(t)["spec"]["template"]["spec"]
    key = next(v for v in pod["volumes"] if v["name"] == L2_KEY_VOLUME)
    # 0440: the non-root server reads it through the pod's fsGroup (security_context).
    assert key["secret"] == {"secretName": f"{t.name}-l2-key", "items": [{"key": "master-key", "path": L2_KEY_FILE}],
                             "defaultMode": 0o440}
    server = pod["containers"][0]
    assert {"name": L2_KEY_VOLUME, "mountPath": L2_KEY_MOUNT_PATH, "readOnly": True} in server["volumeMounts"]
    assert all(m["name"] != L2_KEY_VOLUME for c in pod["containers"][1:] for m in c.get("volumeMounts", []))
    assert not any("secretKeyRef" in json.dumps(e) and "l2-key" in json.dumps(e) for e in server["env"])


def test_the_serde_names_the_key_the_id_was_computed_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the operator renders (controller.reading.target_of): the fingerprint the namespace id
    was computed with (its canonical, lower-case form) and the id, never the key; the server
    refuses to start on a key file of another fingerprint (tests/integration/test_l2_serde.py).
    Without a fingerprint there is no id and no server runs (replicas 0)."""
    from kvpersist.controller import reading, runtime
    from kvpersist.controller.state import Controller

    monkeypatch.setattr(runtime, "CONTROLLER", Controller())
    body = sample("nvme-minimal")
    body["metadata"]["namespace"] = "ml"
    t, _ = reading.target_of(body, KEY_FINGERPRINT.upper())
    serde = l2_adapter_config(t)["serde"]
    assert t.namespace_id == resolve(t.spec.pins(KEY_FINGERPRINT)).namespace_id is not None
    assert (serde["key_fingerprint"], serde["namespace_id"]) == (KEY_FINGERPRINT, t.namespace_id)
    rendered = json.dumps(build_all(t))
    assert base64.b64encode(b"k" * 32).decode() not in rendered and ("k" * 32) not in rendered
    unread, _ = reading.target_of(body, None)
    assert unread.namespace_id is None and unread.key_fingerprint is None
    assert build_lmcache_statefulset(unread)["spec"]["replicas"] == 0
    plain, _ = reading.target_of({**body, "spec": {**body["spec"], "l2": {**body["spec"]["l2"], "encryption": {"enabled": False}}}},
                                 KEY_FINGERPRINT)
    assert plain.namespace_id is not None and plain.key_fingerprint is None
    assert l2_adapter_config(plain)["serde"] == {"type": CHECKED_TYPE, "max_workers": 2, "namespace_id": plain.namespace_id}


def test_the_users_key_secret_is_mounted_and_none_generated() -> None:
    t = target(mutate=lambda o: o["spec"]["l2"].update(encryption={"keySecretRef": {"name": "shared-kv-key", "key": "k"}}))
    pod = build_lmcache_statefulset(t)["spec"]["template"]["spec"]
    key = next(v for v in pod["volumes"] if v["name"] == L2_KEY_VOLUME)
    assert key["secret"]["secretName"] == "shared-kv-key" and key["secret"]["items"] == [{"key": "k", "path": L2_KEY_FILE}]
    assert build_key_secret(t) is None


def test_generated_key_secret_is_random_unowned_and_kept() -> None:
    t = target()
    a, b = build_key_secret(t), build_key_secret(t)
    assert a is not None and b is not None
    assert a["metadata"]["name"] == f"{t.name}-l2-key" and "ownerReferences" not in a["metadata"]
    assert len(base64.b64decode(a["data"]["master-key"])) == L2_KEY_BYTES
    assert a["data"] != b["data"]  # random each time: the handler creates it once and never applies over it
    assert build_key_secret(t, key=b"k" * 32)["data"] == {"master-key": base64.b64encode(b"k" * 32).decode()}
    # Not among the owned objects, so deleting the resource (garbage collection) keeps it.
    assert all(m["kind"] != "Secret" for m in build_all(t))


def test_unencrypted_l2_is_checked_with_no_key_and_another_namespace() -> None:
    """Encryption off is no longer lmcache's bare read (which served damaged files as hits): the
    same frames under a public key, bound to each object's name, with no key file or Secret."""
    plain = target(mutate=lambda o: o["spec"]["l2"].update(encryption={"enabled": False}))
    serde = l2_adapter_config(plain)["serde"]
    assert serde["type"] == CHECKED_TYPE and "master_key_path" not in serde and "key_fingerprint" not in serde
    assert build_key_secret(plain) is None and plain.spec.pins()["l2_serde"] == CHECKED_SERDE
    pod = build_lmcache_statefulset(plain)["spec"]["template"]["spec"]
    assert all(v["name"] != L2_KEY_VOLUME for v in pod.get("volumes", []))
    # Plain and encrypted objects never share a folder: the serde is in the id.
    assert plain.namespace_id is not None and plain.namespace_id != target().namespace_id


# Least privilege (issue 15, docs/security.md): every pod the operator renders, every container.
def _variants() -> list[Target]:
    """Every sample, with the cache off, with an existing claim, and unencrypted: each shape of pod."""
    return [target("nvme-minimal"), target("tp2-fp8"), target("hf-bucket"),
            target(mutate=lambda o: o["spec"]["identity"].pop("chatTemplateDigest")),
            target(mutate=lambda o: o["spec"]["l2"].update(nvme={"existingClaimName": "mine", "maxCapacity": "100Gi"})),
            target(mutate=lambda o: o["spec"]["l2"].update(encryption={"enabled": False}))]


def _pod_templates(t: Target) -> list[tuple[str, dict, set[str]]]:
    """Every pod template among everything build_all renders (with its claim templates' names): a
    new workload cannot skip the walk."""
    return [(m["kind"], m["spec"]["template"]["spec"], {c["metadata"]["name"] for c in m["spec"].get("volumeClaimTemplates", [])})
            for m in build_all(t, "kvpersist-system") if "template" in (m.get("spec") or {})]


@pytest.mark.parametrize("t", _variants(), ids=lambda t: f"{t.name}-{t.spec.l2.kind}-{bool(t.namespace_id)}")
def test_every_container_of_every_pod_is_least_privileged(t: Target) -> None:
    templates = _pod_templates(t)
    assert sorted(kind for kind, _, _ in templates) == ["Deployment", "StatefulSet"]
    for kind, pod, claims in templates:
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, kind
        # None of them calls the API server: no token in the pod.
        assert pod["automountServiceAccountToken"] is False, kind
        assert "privileged" not in json.dumps(pod), kind
        assert not pod.get("hostNetwork") and not pod.get("hostPID"), kind
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        assert not any("hostPath" in v for v in volumes.values()), kind
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert "add" not in sc["capabilities"], c["name"]
            assert "privileged" not in sc, c["name"]
            # Read-only root and non-root everywhere: vLLM's caches and model download go to emptyDirs.
            assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True, c["name"]
            assert {m["name"] for m in c.get("volumeMounts", [])} <= set(volumes) | claims, c["name"]


def test_lmcache_server_writes_only_to_its_volumes() -> None:
    """Read-only root: /tmp is an emptyDir and numba's kernel cache goes there (without it
    lmcache 0.5.6 falls back to CLI-only mode and `lmcache server` exits)."""
    from kvpersist.builders.lmcache import NUMBA_CACHE_DIR
    from kvpersist.builders.security import TMP_PATH, TMP_VOLUME

    pod = build_lmcache_statefulset(target())["spec"]["template"]["spec"]
    server = pod["containers"][0]
    assert {"name": "NUMBA_CACHE_DIR", "value": NUMBA_CACHE_DIR} in server["env"]
    assert NUMBA_CACHE_DIR.startswith(TMP_PATH + "/")
    assert {"name": TMP_VOLUME, "mountPath": TMP_PATH} in server["volumeMounts"]
    assert next(v for v in pod["volumes"] if v["name"] == TMP_VOLUME)["emptyDir"]["sizeLimit"]
    # The claim stays the first mount (the agent shares it), the key read-only.
    assert server["volumeMounts"][0] == {"name": "l2", "mountPath": L2_MOUNT_PATH}
    assert all(m.get("readOnly") for m in server["volumeMounts"] if m["name"] == L2_KEY_VOLUME)


@pytest.mark.parametrize("name", ["nvme-minimal", "hf-bucket"])
def test_the_agent_is_non_root_in_the_pods_data_group_and_the_servers_run_as_vllms_uid(name: str) -> None:
    """The agent reads and deletes what the lmcache server wrote through the pod's fsGroup
    (measured: docs/security.md): non-root, no capability. lmcache and vLLM run as one non-root uid
    (vLLM's shared-memory KV is 0600 of its uid), the server in the data group, each with HOME and
    /tmp as emptyDirs under a read-only root."""
    from kvpersist.builders.security import DATA_PLANE_HOME, DATA_PLANE_USER
    pod = build_lmcache_statefulset(target(name))["spec"]["template"]["spec"]
    server, agent = pod["containers"]
    sc = agent["securityContext"]
    assert (sc["runAsUser"], sc["runAsGroup"], sc["runAsNonRoot"]) == (65532, 2000, True) and sc["readOnlyRootFilesystem"]
    assert pod["securityContext"]["fsGroup"] == 2000 and pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    token = next(v for v in pod["volumes"] if v["name"] == "agent-token")["secret"]
    assert token["defaultMode"] == 0o440  # the agent reads it as a member of the pod's group
    vllm = build_vllm_deployment(target())["spec"]["template"]["spec"]
    assert (server["securityContext"]["runAsUser"], server["securityContext"]["runAsGroup"]) == (DATA_PLANE_USER, 2000)
    assert vllm["containers"][0]["securityContext"]["runAsUser"] == DATA_PLANE_USER and "fsGroup" not in vllm["securityContext"]
    for spec in (pod, vllm):
        c = spec["containers"][0]
        assert {"name": "HOME", "value": DATA_PLANE_HOME} in c["env"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert all("emptyDir" in volumes[mounts[path]] for path in (DATA_PLANE_HOME, "/tmp")), mounts


def test_a_users_claim_is_never_re_owned_by_the_pods_fs_group() -> None:
    """spec.l2.nvme.existingClaimName is a claim the operator did not make: its server pod sets no
    fsGroup (nor fsGroupChangePolicy), so the kubelet never chgrps and makes group-writable the
    user's files (Postgres and others refuse group-writable data). The agent's token file, then
    root's, is readable by the agent's container alone (only it mounts it). The operator's own
    claims (volumeClaimTemplates) keep the data group."""
    users = target(mutate=lambda o: o["spec"]["l2"].update(nvme={"existingClaimName": "pg-data", "maxCapacity": "100Gi"}))
    pod = build_lmcache_statefulset(users)["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert {"name": "l2", "persistentVolumeClaim": {"claimName": "pg-data"}} in pod["volumes"]
    token = next(v for v in pod["volumes"] if v["name"] == "agent-token")["secret"]
    assert token["defaultMode"] == 0o444
    assert [c["name"] for c in pod["containers"] if any(m["name"] == "agent-token" for m in c["volumeMounts"])] == [
        "inventory-agent"]
    agent = pod["containers"][1]["securityContext"]
    assert (agent["runAsUser"], agent["runAsGroup"], agent["runAsNonRoot"]) == (65532, 2000, True)
    own = build_lmcache_statefulset(target())["spec"]
    assert "volumeClaimTemplates" in own
    assert own["template"]["spec"]["securityContext"]["fsGroup"] == 2000


def test_no_pod_uses_a_host_namespace_and_the_runtime_class_is_the_users() -> None:
    """Isolated CUDA IPC needs no host namespace (tests/contract/test_gpu_pod_contract.py), so
    the baseline Pod Security level admits every pod, cache on or off; runtimeClassName ""
    leaves the node's default runtime."""
    off = target(mutate=lambda o: o["spec"]["identity"].pop("chatTemplateDigest"))
    for t in (target(), target("tp2-fp8"), target("hf-bucket"), off):
        for pod in (build_lmcache_statefulset(t)["spec"]["template"]["spec"],
                    build_vllm_deployment(t)["spec"]["template"]["spec"]):
            assert not {"hostIPC", "hostPID", "hostNetwork"} & set(pod)
            assert pod["runtimeClassName"] == "nvidia"
    default_runtime = target(mutate=lambda o: (o["spec"].setdefault("lmcacheServer", {}).update(runtimeClassName=""),
                                               o["spec"]["vllm"].update(runtimeClassName="gpu")))
    assert "runtimeClassName" not in build_lmcache_statefulset(default_runtime)["spec"]["template"]["spec"]
    assert build_vllm_deployment(default_runtime)["spec"]["template"]["spec"]["runtimeClassName"] == "gpu"


def test_the_agent_gets_its_token_as_a_file_and_only_the_agent() -> None:
    t = dataclasses.replace(target(), agent_image="img:1")
    pod = build_lmcache_statefulset(t)["spec"]["template"]["spec"]
    server, agent = pod["containers"]
    token_file = _flag(agent["args"], "--token-file")
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "agent-token")
    assert token_file.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
    assert all(m["name"] != "agent-token" for m in server["volumeMounts"])
    volume = next(v for v in pod["volumes"] if v["name"] == "agent-token")
    assert volume["secret"]["secretName"] == f"{t.name}-agent-token" and volume["secret"]["defaultMode"] == 0o440
    secret = build_agent_token_secret(t)
    assert secret is not None and secret["metadata"]["name"] == f"{t.name}-agent-token"
    assert len(base64.b64decode(secret["data"]["token"])) == 64 and build_agent_token_secret(t)["data"] != secret["data"]
    # A bucket's server pods have an agent too (it forwards lmcache's /status), so a token as well.
    assert build_agent_token_secret(target("hf-bucket"))["metadata"]["name"] == "qwen25-7b-bucket-agent-token"


def test_a_policy_without_rules_renders_no_ingress_key() -> None:
    """`ingress: []` is stored as absent: applied each time, it would bump the generation forever."""
    from kvpersist.builders.lmcache import build_network_policy

    t = target(mutate=lambda o: o["spec"]["identity"].pop("chatTemplateDigest"))  # the cache off: no ZMQ rule
    assert "ingress" not in build_network_policy(t, None)["spec"]
    assert build_network_policy(t, "kvpersist-system")["spec"]["ingress"]


def test_a_server_no_node_can_take_stops_counting_against_the_disruption_budget() -> None:
    """Issue 58 item 3: with more servers than eligible nodes one stays Pending for good, and with
    maxUnavailable 1 it uses up the budget: every drain of a node with a Ready server hangs. Once
    the scheduler has found no node for it for UNPLACED_AFTER_S it is not counted: the budget
    allows 1 + that many. A server Pending a shorter while (a drained node's replacement) still
    counts, and so do vLLM pods never."""
    import dataclasses
    import datetime

    from kvpersist.builders.lmcache import build_server_pdb
    from kvpersist.builders.target import SERVER, VLLM
    from kvpersist.status.workloads import UNPLACED_AFTER_S, slim, unplaced_servers

    now = datetime.datetime(2026, 12, 6, 12, 0, tzinfo=datetime.UTC)

    def pod(name: str, component: str, pending_s: float | None) -> dict:
        conditions = [] if pending_s is None else [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available",
             "lastTransitionTime": (now - datetime.timedelta(seconds=pending_s)).strftime("%Y-%m-%dT%H:%M:%SZ")}]
        return slim({"metadata": {"name": name, "namespace": "ml", "labels": {"app.kubernetes.io/component": component}},
                     "spec": {"containers": [{"name": component}]},
                     "status": {"phase": "Pending" if pending_s is not None else "Running", "conditions": conditions}})

    kept = pod("r-lmcache-2", SERVER, UNPLACED_AFTER_S + 60)
    assert kept["status"]["conditions"] == [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                             "lastTransitionTime": "2026-12-06T11:49:00Z"}]
    pods = [pod("r-lmcache-0", SERVER, None), pod("r-lmcache-1", SERVER, 30), kept,
            pod("r-vllm-a", VLLM, UNPLACED_AFTER_S * 2)]
    assert unplaced_servers(pods, now) == 1
    assert unplaced_servers(pods, now + datetime.timedelta(seconds=UNPLACED_AFTER_S)) == 2
    t = target(mutate=lambda o: o["spec"].update(lmcacheServer={"replicas": 2}))
    assert build_server_pdb(t)["spec"]["maxUnavailable"] == 1
    assert build_server_pdb(dataclasses.replace(t, unplaced_servers=1))["spec"]["maxUnavailable"] == 2
