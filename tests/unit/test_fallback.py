"""vLLM without the cache while its servers stay unavailable, back with it once they are healthy
(kvpersist.controller.fallback), and what the builders render for each."""

from __future__ import annotations

import dataclasses

from kvpersist.builders.lmcache import build_lmcache_statefulset
from kvpersist.builders.vllm import build_vllm_deployment
from kvpersist.controller.fallback import Fallback, bypassed_in
from tests.unit.test_builders import target

KEY = ("ns", "a")


def test_bypass_after_the_bound_and_back_after_the_recovery_time() -> None:
    f = Fallback(after_s=120, recover_s=30)
    assert f.observe(KEY, False, 0.0) is None and not f.bypassed(KEY)
    assert f.observe(KEY, False, 119.0) is None
    assert f.observe(KEY, False, 120.0) is True and f.bypassed(KEY)
    assert f.observe(KEY, False, 500.0) is None  # said once
    assert f.observe(KEY, True, 600.0) is None and f.bypassed(KEY)  # healthy, not yet for long enough
    assert f.observe(KEY, False, 610.0) is None and f.bypassed(KEY)  # a flap restarts the count
    assert f.observe(KEY, True, 620.0) is None
    assert f.observe(KEY, True, 650.0) is False and not f.bypassed(KEY)
    assert f.observe(("ns", "b"), False, 650.0) is None  # per resource


def test_servers_back_before_the_bound_never_bypass() -> None:
    f = Fallback(after_s=120, recover_s=30)
    f.observe(KEY, False, 0.0)
    f.observe(KEY, True, 100.0)
    assert f.observe(KEY, False, 110.0) is None and f.observe(KEY, False, 200.0) is None and not f.bypassed(KEY)
    assert f.observe(KEY, False, 230.0) is True  # 120 s from 110


def test_a_restarted_operator_keeps_what_the_status_says() -> None:
    body = {"status": {"conditions": [{"type": "CacheBypassed", "status": "True"}]}}
    assert bypassed_in(body) and not bypassed_in({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    f = Fallback(after_s=120, recover_s=30)
    f.seed(KEY, bypassed_in(body))
    assert f.bypassed(KEY)
    f.seed(KEY, False)  # seeded once: later statuses are the operator's own
    assert f.bypassed(KEY)
    assert f.observe(KEY, True, 0.0) is None and f.observe(KEY, True, 30.0) is False


def test_bypassed_vllm_has_no_connector_affinity_or_host_ipc_and_the_servers_stay() -> None:
    on = target()
    off = dataclasses.replace(on, cache_bypassed=True)
    with_cache, without = build_vllm_deployment(on), build_vllm_deployment(off)
    args = without["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--kv-transfer-config" in with_cache["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--kv-transfer-config" not in args and "--revision" in args  # the pins stay
    pod = without["spec"]["template"]["spec"]
    assert "affinity" not in pod and "hostIPC" not in pod
    said = without["spec"]["template"]["metadata"]["annotations"]["kvpersist.dev/cache-bypassed"]
    assert said.startswith("the lmcache servers are unavailable")
    refused = dataclasses.replace(off, bypass_reason="a vLLM pod refused its lmcache/vLLM build")
    said = build_vllm_deployment(refused)["spec"]["template"]["metadata"]["annotations"]["kvpersist.dev/cache-bypassed"]
    assert said.startswith("a vLLM pod refused")  # the pods say which bypass it is
    assert "kvpersist.dev/cache-bypassed" not in with_cache["spec"]["template"]["metadata"]["annotations"]
    assert build_lmcache_statefulset(off) == build_lmcache_statefulset(on)
