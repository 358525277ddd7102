"""The local cluster's kubelet stand-in: Service names resolve only to Ready endpoints the Service
selects (same node under internalTrafficPolicy Local), probes follow their thresholds, vLLM
runs for real only when its model is in the local cache, and a runner plays one node: it runs
only that node's pods, and a ReadWriteMany claim is one folder for the runners of all nodes."""

from __future__ import annotations

import http.server
import json
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import kubelet_runner  # noqa: E402
from kubelet_runner import (  # noqa: E402
    REAL_NODE,
    SECOND_NODE,
    TERMINATION_LOG_ENV,
    Probe,
    Runner,
    flag_value,
    hosts_file,
    localize_args,
    pod_loopback,
    program,
)


def pod(name: str, ip: str, node: str, ready: bool, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"nodeName": node},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]}}


def service(name: str, local: bool, **selector: str) -> dict:
    return {"metadata": {"name": name, "namespace": "ns"},
            "spec": {"selector": selector, **({"internalTrafficPolicy": "Local"} if local else {})}}


def test_hosts_resolve_services_to_ready_selected_endpoints() -> None:
    pods = [pod("a", "127.16.0.5", "n1", False, app="srv"), pod("b", "127.16.0.9", "n2", True, app="srv"),
            pod("c", "127.16.0.7", "n1", True, app="other")]
    text = hosts_file(pods, [service("local", True, app="srv"), service("any", False, app="srv"),
                             service("headless-no-selector", False)], node="n1")
    lines = text.splitlines()
    assert lines[0] == "127.0.0.1\tlocalhost"
    # Local: the only Ready srv pod is on n2, so nothing on n1 resolves the name (as kube-proxy drops it).
    assert not any("local.ns.svc" in line for line in lines)
    assert "127.16.0.9\tany.ns.svc.cluster.local. any.ns.svc.cluster.local any.ns.svc any.ns any" in lines
    assert len(lines) == 2


def test_probe_thresholds() -> None:
    codes = iter([503, 200, 200, 503, 503, 503])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(next(codes))
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        probe = Probe({"httpGet": {"path": "/h", "port": "http"}, "successThreshold": 2, "failureThreshold": 3})
        ports = {"http": server.server_address[1]}
        seen = []
        for t in range(6):
            probe.run("127.0.0.1", ports, float(t))
            seen.append(probe.ok)
        assert seen == [False, False, True, True, True, False]
    finally:
        server.shutdown()


def test_the_pods_loopback_is_its_own_address_and_exec_probes_run_there(tmp_path: Path) -> None:
    """What the rendered lmcache server binds as 127.0.0.1 (its admin API) and what its exec probe
    asks map to one address of the pod's, not the pod IP; the probe passes only when it answers."""
    from kvpersist.api.v1alpha1 import KVCacheNamespace
    from kvpersist.builders.lmcache import server_container
    from kvpersist.builders.target import Target
    from tests.cases.invalid_manifests import sample

    ip = "127.16.3.4"
    assert pod_loopback(ip) == "127.116.3.4" and pod_loopback("127.19.0.9") == "127.119.0.9"
    obj = sample("nvme-minimal")
    container = server_container(Target("s", "ns", KVCacheNamespace.model_validate(obj).spec, None))
    args = localize_args(container["args"], {}, ip, loopback=pod_loopback(ip))
    assert flag_value(args, "--http-host") == "127.116.3.4" and flag_value(args, "--host") == ip
    assert flag_value(localize_args(container["args"], {}, "127.0.0.1"), "--http-host") == "127.0.0.1"  # no pod: as is

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthcheck" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    runner = Runner(tmp_path / "kubeconfig", "ns", tmp_path, lmcache="/opt/lmcache")
    # The shell wrapper (umask, build check) runs this machine's python3 as its $0 (the one beside
    # its lmcache when there is one: kvpersist.inserver.serve runs lmcache), on the pod's own addresses.
    argv = runner.argv({"spec": {"volumes": []}, "status": {"podIP": ip}}, {**container, "volumeMounts": []})
    assert argv[:4] == ["sh", "-c", container["command"][2], sys.executable] and argv[4:] == args
    # The port the probe names, served on the pod's loopback address; nothing on the pod IP.
    server = http.server.HTTPServer(("127.116.3.4", 0), Handler)
    port = server.server_address[1]
    spec = {**container["readinessProbe"], "failureThreshold": 1}
    spec["exec"] = {"command": [*spec["exec"]["command"][:-1], f"http://127.0.0.1:{port}/healthcheck"]}
    the_pod = {"status": {"podIP": ip}}
    probe = runner._probe(spec, the_pod, {"PATH": "/usr/bin:/bin"})
    assert probe is not None and probe.exec_argv[0] == sys.executable
    assert probe.exec_argv[-1] == f"http://127.116.3.4:{port}/healthcheck"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert probe.run(ip, {}, 0.0) and probe.ok
    finally:
        server.shutdown()
        server.server_close()
    assert not probe.run(ip, {}, 1.0) and not probe.ok  # nothing answers any more


def test_the_kv_events_socket_binds_the_pod_ip_not_every_interface() -> None:
    """vLLM's PUB socket (spec.vllm.kvEvents, tcp://*:PORT) binds the pod's address, in the
    IPv4-mapped spelling vLLM still binds (an endpoint without `*` or `::` it connects to); two vLLM
    pods on this machine then never take each other's port, as pods in their own network namespaces."""
    from kvpersist.api.v1alpha1 import KVCacheNamespace
    from kvpersist.builders.target import Target
    from kvpersist.builders.vllm import vllm_args
    from kvpersist.identity import resolve
    from tests.cases.invalid_manifests import sample

    obj = sample("nvme-minimal")
    obj["spec"]["l2"]["encryption"] = {"enabled": False}
    obj["spec"]["vllm"]["kvEvents"] = {"enabled": True, "replayPort": 5558}
    spec = KVCacheNamespace.model_validate(obj).spec
    args = localize_args(vllm_args(Target("r", "ns", spec, resolve(spec.pins()).namespace_id)), {}, "127.16.3.4")
    events = json.loads(flag_value(args, "--kv-events-config") or "{}")
    assert events["endpoint"] == "tcp://[::ffff:127.16.3.4]:5557" and events["replay_endpoint"] == "tcp://[::ffff:127.16.3.4]:5558"
    assert "::" in events["endpoint"]  # what vllm.distributed.kv_events.ZmqEventPublisher._is_bind_endpoint binds
    assert flag_value(args, "--host") == "127.16.3.4"


def test_vllm_is_real_only_with_build_and_cached_model(tmp_path: Path) -> None:
    args = ["serve", "org/m", "--revision", "a" * 40, "--port", "8000"]
    container = {"command": ["vllm"], "args": args}
    runner = Runner(tmp_path / "kc", "ns", tmp_path)
    assert "no vLLM build" in runner.why_simulated(container)
    runner.vllm, runner.hf_home = "/x/vllm", tmp_path / "hf"
    assert "not in this machine's cache" in runner.why_simulated(container)
    (tmp_path / "hf" / "hub" / "models--org--m" / "snapshots" / ("a" * 40)).mkdir(parents=True)
    assert runner.why_simulated(container) == ""
    assert runner.why_simulated({"command": ["vllm", "serve"], "args": args[1:]}) == ""  # as llm-d writes it
    assert runner.why_simulated({"command": ["lmcache"], "args": []}) == ""
    assert flag_value(["--revision=abc"], "--revision") == "abc" and flag_value(args, "--port") == "8000"


def test_secret_volume_becomes_files_and_its_path_is_mapped(tmp_path: Path, monkeypatch) -> None:
    """The rendered server pod's key Secret volume: the listed item as a file, with its mode, and
    the mount path in the args (inside the --l2-adapter JSON) pointing at it."""
    import base64
    import json

    from kvpersist.api.v1alpha1 import KVCacheNamespace
    from kvpersist.builders.lmcache import build_lmcache_statefulset
    from kvpersist.builders.target import L2_KEY_FILE, Target
    from kvpersist.identity import key_fingerprint, resolve
    from tests.cases.invalid_manifests import sample

    spec = KVCacheNamespace.model_validate(sample()).spec
    key = bytes(range(32))
    target = Target("llama31-8b", "ns", spec, resolve(spec.pins(key_fingerprint(key))).namespace_id)
    template = build_lmcache_statefulset(target)["spec"]["template"]
    secrets = {"llama31-8b-l2-key": {"data": {"master-key": base64.b64encode(key).decode()}}}
    runner = Runner(tmp_path / "kc", "ns", tmp_path)
    monkeypatch.setattr(runner, "_kubectl_json", lambda *args: secrets[args[2]])
    pod = {"metadata": {"name": "llama31-8b-lmcache-0"}, "spec": template["spec"] | {"volumes": [
        *template["spec"]["volumes"], {"name": "l2", "persistentVolumeClaim": {"claimName": "l2-llama31-8b-lmcache-0"}}]},
        "status": {"podIP": "127.16.0.9"}}
    argv = runner.argv(pod)
    adapter = json.loads(argv[argv.index("--l2-adapter") + 1])
    key_file = Path(adapter["serde"]["master_key_path"])
    assert key_file.name == L2_KEY_FILE and key_file.is_relative_to(tmp_path) and key_file.read_bytes() == key
    assert key_file.stat().st_mode & 0o777 == 0o440
    assert adapter["base_path"].startswith(str(tmp_path))  # fs_native's folder


def test_wrapped_programs_are_still_this_machines_builds(tmp_path: Path) -> None:
    """The build check wraps lmcache and vLLM in `sh -c SCRIPT PROGRAM` (kvpersist.builders.buildcheck):
    the runner still knows vLLM by its `$0` (simulated without a build, the CPU build's env
    otherwise), and the script's python3 is the one beside the program (its venv), as in an image."""
    from kvpersist.builders import buildcheck
    from kvpersist.builders.lmcache import server_container
    from kvpersist.builders.vllm import build_vllm_deployment
    from tests.unit.test_builders import target

    vllm = build_vllm_deployment(target())["spec"]["template"]["spec"]["containers"][0]
    server = server_container(target())
    assert vllm["command"][0] == "sh" and program(vllm) == "vllm" and program(server) == "python3"
    assert program({"command": ["kvpersist"]}) == "kvpersist"
    lmcache_bin = tmp_path / "lmcache-venv" / "bin"
    lmcache_bin.mkdir(parents=True)
    for name in ("lmcache", "python3"):
        (lmcache_bin / name).touch(mode=0o755)
    runner = Runner(tmp_path / "kc", "ns", tmp_path, lmcache=str(lmcache_bin / "lmcache"))
    assert "no vLLM build" in runner.why_simulated(vllm)
    runner.vllm = "/opt/vllm-venv/bin/vllm"
    env = runner._env(vllm)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["PATH"].startswith("/opt/vllm-venv/bin:")
    assert env["KVPERSIST_EXPECT_VLLM"] == "0.33.0"
    assert runner._env(server)["PATH"].startswith(f"{lmcache_bin}:")  # the server's python3 is lmcache's
    assert runner.argv({"spec": {"volumes": []}, "status": {"podIP": "127.16.0.2"}}, server)[3] == str(lmcache_bin / "python3")
    assert runner.argv({"spec": {"volumes": []}, "status": {"podIP": "127.16.0.2"}}, vllm)[3] == "/opt/vllm-venv/bin/vllm"
    assert runner.termination_file("uid/vllm") == tmp_path / "termination" / "uid" / "vllm"
    assert TERMINATION_LOG_ENV == buildcheck.TERMINATION_LOG_ENV  # the runner's file is where the check writes


def _server_pod(uid: str, name: str, node: str, ip: str, claim: str) -> dict:
    """The operator's lmcache server pod (its rendered template) bound to `node`, mounting `claim`."""
    from kvpersist.builders.lmcache import build_lmcache_statefulset
    from tests.unit.test_builders import target

    template = build_lmcache_statefulset(target())["spec"]["template"]
    volumes = [v for v in template["spec"]["volumes"] if "secret" not in v]
    mounts = {v["name"] for v in volumes}
    containers = [{**c, "volumeMounts": [m for m in c.get("volumeMounts", []) if m["name"] in mounts | {"l2"}]}
                  for c in template["spec"]["containers"]]
    return {"metadata": {"uid": uid, "name": name, "labels": template["metadata"]["labels"]},
            "spec": {**template["spec"], "nodeName": node, "containers": containers,
                     "volumes": [*volumes, {"name": "l2", "persistentVolumeClaim": {"claimName": claim}}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": []}}


def test_each_runner_runs_only_its_nodes_pods_and_a_shared_claim_is_one_folder(tmp_path: Path, monkeypatch) -> None:
    """Two runners, one per real node, over one namespace: each starts the containers of the pods
    bound to its own node and no other; the servers' ReadWriteMany claim maps to the same folder
    in both (one shared filesystem), their ReadWriteOnce claims to folders of each node's own."""
    pods = [_server_pod("a", "s-0", REAL_NODE, "127.16.0.4", "shared-l2"),
            _server_pod("b", "s-1", SECOND_NODE, "127.16.1.4", "shared-l2"),
            _server_pod("c", "s-2", REAL_NODE, "127.16.0.5", "own-l2-0"),
            _server_pod("d", "s-3", SECOND_NODE, "127.16.1.5", "own-l2-1"),
            _server_pod("e", "s-4", "kwok-gpu-0", "127.16.2.4", "own-l2-2")]
    claims = [{"metadata": {"name": "shared-l2"}, "spec": {"accessModes": ["ReadWriteMany"]}},
              *({"metadata": {"name": f"own-l2-{i}"}, "spec": {"accessModes": ["ReadWriteOnce"]}} for i in range(3))]
    answers = {"pods": {"items": pods}, "services": {"items": []}, "persistentvolumeclaims": {"items": claims}}
    started: dict[str, list[tuple[str | None, list[str]]]] = {}  # node -> (--host, argv) of each start
    syncing = [""]  # the node whose runner is syncing

    class FakeProc:
        """A started container that never exits (no process: the runner's bookkeeping is under test)."""

        pid, returncode = 0, None

        def __init__(self, argv: list[str], **_: object) -> None:
            started.setdefault(syncing[0], []).append((flag_value(argv, "--host"), argv))

        def poll(self) -> None:
            return None

    monkeypatch.setattr(kubelet_runner.subprocess, "Popen", FakeProc)
    shared = tmp_path / "shared-fs"
    runners = {n: Runner(tmp_path / "kc", "ns", tmp_path / n, lmcache="/opt/lmcache", node=n, shared_dir=shared)
               for n in (REAL_NODE, SECOND_NODE)}
    for node, runner in runners.items():
        syncing[0] = node
        monkeypatch.setattr(runner, "_kubectl_json", lambda *args: answers[args[1]])
        monkeypatch.setattr(runner, "_report", lambda pod: None)
        runner.sync()
    # Each runner started exactly the containers of its own node's pods, on their pod IPs.
    assert {ip for ip, _ in started[REAL_NODE]} - {None} == {"127.16.0.4", "127.16.0.5"}
    assert {ip for ip, _ in started[SECOND_NODE]} - {None} == {"127.16.1.4", "127.16.1.5"}
    assert {k.split("/")[0] for k in runners[REAL_NODE].containers} == {"a", "c"}
    assert {k.split("/")[0] for k in runners[SECOND_NODE].containers} == {"b", "d"}

    def l2_path(node: str, ip: str) -> str:
        argv = next(a for i, a in started[node] if i == ip and "--l2-adapter" in a)
        adapter = json.loads(argv[argv.index("--l2-adapter") + 1])
        return adapter.get("base_path") or adapter["backend_params"]["file_path"]  # fs_native's, or nixl's

    a, b = runners[REAL_NODE], runners[SECOND_NODE]
    assert a.volume_dir("shared-l2") == b.volume_dir("shared-l2") == shared / "volumes" / "ns" / "shared-l2"
    assert l2_path(REAL_NODE, "127.16.0.4").startswith(str(shared / "volumes" / "ns" / "shared-l2"))
    assert l2_path(SECOND_NODE, "127.16.1.4").startswith(str(shared / "volumes" / "ns" / "shared-l2"))
    # ReadWriteOnce: each node's own folder, as a local disk (the one-node runner's path, unchanged).
    assert l2_path(REAL_NODE, "127.16.0.5").startswith(str(tmp_path / REAL_NODE / "volumes" / "ns" / "own-l2-0"))
    assert l2_path(SECOND_NODE, "127.16.1.5").startswith(str(tmp_path / SECOND_NODE / "volumes" / "ns" / "own-l2-1"))
    assert a.volume_dir("own-l2-0") != b.volume_dir("own-l2-0")
    for runner in runners.values():
        runner.containers.clear()  # nothing to stop: no process was started


def test_node_local_service_resolves_to_the_server_on_the_pods_own_node() -> None:
    """The operator's node-local Service (internalTrafficPolicy Local) as the runner resolves it in
    each node's /etc/hosts: vLLM on node B reaches node B's server, on node A node A's; a node
    whose server is not Ready gets no entry (kube-proxy drops the traffic), never the other node's."""
    from kvpersist.builders.lmcache import build_local_service
    from tests.unit.test_builders import target

    t = target()
    local = build_local_service(t)
    local["metadata"]["namespace"] = "ns"
    labels = t.labels("lmcache-server")
    servers = [pod("s-0", "127.16.0.4", REAL_NODE, True, **labels), pod("s-1", "127.16.1.4", SECOND_NODE, True, **labels)]
    name = local["metadata"]["name"]
    for node, ip in ((REAL_NODE, "127.16.0.4"), (SECOND_NODE, "127.16.1.4")):
        entry = [line for line in hosts_file(servers, [local], node).splitlines() if name in line]
        assert entry and entry[0].startswith(f"{ip}\t"), (node, entry)
    servers[1]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    assert name not in hosts_file(servers, [local], SECOND_NODE)


def test_emptydirs_are_bound_under_a_read_only_root_and_the_hub_cache_is_the_machines(tmp_path: Path) -> None:
    """readOnlyRootFilesystem: `/` read-only, each emptyDir a folder of the pod's at its mountPath
    (not a memory /dev/shm: this machine's stays), the runner's folders and the model cache kept
    writable; the vLLM container's HF_HUB_CACHE emptyDir is the machine's hub folder (no Hub here)."""
    hf = tmp_path / "hf"
    runner = Runner(tmp_path / "kc", "ns", tmp_path / "work", vllm="/opt/vllm", hf_home=hf)
    spec = {"volumes": [{"name": "home", "emptyDir": {}}, {"name": "models", "emptyDir": {}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}}, {"name": "key", "secret": {"secretName": "s"}}],
            "containers": [{"name": "main", "command": ["vllm"], "securityContext": {"readOnlyRootFilesystem": True},
                            "volumeMounts": [{"name": "home", "mountPath": "/home"}, {"name": "models", "mountPath": "/models"},
                                             {"name": "dshm", "mountPath": "/dev/shm"}, {"name": "key", "mountPath": "/k"}]}]}
    p = {"metadata": {"name": "p", "uid": "u1"}, "spec": spec}
    got = runner.mounts(p, spec["containers"][0], tmp_path / "hosts", {"HF_HUB_CACHE": "/models"})
    assert got["readOnly"] is True and got["hosts"] == str(tmp_path / "hosts")
    assert got["binds"] == [[str(tmp_path / "work" / "emptydirs" / "u1" / "home"), "/home"], [str(hf / "hub"), "/models"]]
    assert got["keep"] == [str(tmp_path / "work"), str(hf), str(Path.cwd())]
    plain = {**spec["containers"][0], "command": ["lmcache"], "securityContext": {}}
    got = runner.mounts(p, plain, tmp_path / "hosts", {"HF_HUB_CACHE": "/models"})
    assert got["readOnly"] is False and got["binds"][2] == [str(tmp_path / "work" / "emptydirs" / "u1" / "models"), "/models"]
    # A writable root: /tmp is the container's own (first, so the kept folders under /tmp show through
    # it), a folder of the pod's that goes with it; unless the pod mounts a volume there.
    assert got["binds"][0] == [str(tmp_path / "work" / "emptydirs" / "u1" / ".tmp-main"), "/tmp"]
    with_tmp = {**plain, "volumeMounts": [*plain["volumeMounts"], {"name": "home", "mountPath": "/tmp"}]}
    got = runner.mounts(p, with_tmp, tmp_path / "hosts", {})
    assert [b for b in got["binds"] if b[1] == "/tmp"] == [[str(tmp_path / "work" / "emptydirs" / "u1" / "home"), "/tmp"]]


def test_args_expand_the_containers_own_variables_as_a_kubelet_does() -> None:
    env = {"KVPERSIST_POD_IP": "127.16.0.9", "PATH": "/bin"}
    assert kubelet_runner.expand('{"topic":"kv@$(KVPERSIST_POD_IP):8000@m"}', env) == '{"topic":"kv@127.16.0.9:8000@m"}'
    assert kubelet_runner.expand("$(UNSET) $$(KVPERSIST_POD_IP) $(PATH)", env) == "$(UNSET) $(KVPERSIST_POD_IP) /bin"
