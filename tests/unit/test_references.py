"""ReferencesFound (issue 42 item 7): every Secret and ConfigMap a spec names, and a condition that
names each one missing. Pure: the lookups are given; the API server's side is
tests/e2e/test_secrets.py::test_a_missing_secret_or_configmap_is_named_in_a_condition."""

from __future__ import annotations

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.status import references
from kvpersist.status.conditions import compute_status
from kvpersist.status.references import CONFIGMAP, SECRET, Reference
from tests.cases.invalid_manifests import sample
from tests.unit.test_conditions import obs, pod, rollout


def _spec(mutate) -> KVCacheNamespace:
    obj = sample("nvme-minimal")
    mutate(obj["spec"])
    return KVCacheNamespace.model_validate(obj)


def _every_reference(spec: dict) -> None:
    spec["vllm"]["hfTokenSecretRef"] = {"name": "hf"}
    spec["vllm"]["apiKeySecretRef"] = {"name": "api"}
    spec["vllm"]["envFrom"] = [{"secretRef": {"name": "env-s"}}, {"configMapRef": {"name": "env-c"}}]
    spec["imagePullSecrets"] = [{"name": "pull"}]
    spec["prewarm"] = {"configMapRef": {"name": "prompts"}}
    spec["l2"]["encryption"] = {"enabled": True, "keySecretRef": {"name": "key"}}


def test_every_named_secret_and_configmap_is_listed_with_its_field() -> None:
    refs = references.named(_spec(_every_reference).spec)
    assert refs == [
        Reference("spec.l2.encryption.keySecretRef", SECRET, "key"),
        Reference("spec.vllm.hfTokenSecretRef", SECRET, "hf"),
        Reference("spec.vllm.apiKeySecretRef", SECRET, "api"),
        Reference("spec.vllm.envFrom[0].secretRef", SECRET, "env-s"),
        Reference("spec.vllm.envFrom[1].configMapRef", CONFIGMAP, "env-c"),
        Reference("spec.imagePullSecrets[0]", SECRET, "pull"),
        Reference("spec.prewarm.configMapRef", CONFIGMAP, "prompts"),
    ]


def test_each_missing_object_is_named_with_its_field_kind_and_the_fix() -> None:
    refs = references.named(_spec(_every_reference).spec)
    present = {(SECRET, "key"), (SECRET, "hf"), (SECRET, "pull")}
    ok, reason, message = references.judge(refs, "team-a", lambda kind, name: (kind, name) in present)
    assert (ok, reason) == (False, references.MISSING)
    for field, kind, name in (("spec.vllm.apiKeySecretRef", "Secret", "api"), ("spec.vllm.envFrom[0].secretRef", "Secret", "env-s"),
                              ("spec.vllm.envFrom[1].configMapRef", "ConfigMap", "env-c"),
                              ("spec.prewarm.configMapRef", "ConfigMap", "prompts")):
        assert f"{field} names {kind} {name}, which does not exist in team-a" in message
    assert "Secret hf" not in message and "Secret pull" not in message
    assert "the vLLM pods do not start" in message and "create each in the resource's namespace" in message


def test_all_present_unknown_and_none_named() -> None:
    refs = references.named(_spec(_every_reference).spec)
    assert references.judge(refs, "ns", lambda kind, name: True)[:2] == (True, references.FOUND)
    # A cache that has not listed says nothing either way: never "missing" from no listing.
    assert references.judge(refs, "ns", lambda kind, name: None)[:2] == (None, "NotChecked")
    plain = _spec(lambda s: s["l2"].update(encryption={"enabled": False}))
    assert references.named(plain.spec) == [] and references.judge([], "ns", lambda k, n: False) is None


def test_a_missing_reference_names_why_ready_is_false_but_never_holds_back_serving_pods() -> None:
    missing = (False, references.MISSING, "spec.vllm.apiKeySecretRef names Secret api, which does not exist in ns")
    fields, conds = compute_status(obs(references=missing, deployment=rollout(0, 1)))
    by_type = {c["type"]: c for c in conds}
    assert by_type["ReferencesFound"]["status"] == "False"
    assert (by_type["Ready"]["reason"], fields["phase"]) == (references.MISSING, "Progressing")
    assert "spec.vllm.apiKeySecretRef names Secret api" in by_type["Ready"]["message"]
    # Every pod serving (a missing pull Secret of a public image): reported, Ready stays True.
    fields, conds = compute_status(obs(references=missing, server_pods=[pod("s-0", True)]))
    assert fields["phase"] == "Ready" and {c["type"]: c["status"] for c in conds}["ReferencesFound"] == "False"


def test_a_warning_event_once_per_message_and_a_normal_one_when_all_exist() -> None:
    from kvpersist.controller.transitions import events_for

    def cond(status: str, reason: str, message: str) -> dict:
        return {"type": "ReferencesFound", "status": status, "reason": reason, "message": message}

    missing = cond("False", references.MISSING, "spec.imagePullSecrets[0] names Secret pull, which does not exist in ns")
    assert ("Warning", references.MISSING, missing["message"]) in events_for({}, {}, [missing])
    assert not [e for e in events_for({"conditions": [missing]}, {}, [missing]) if e[1] == references.MISSING]
    found = cond("True", references.FOUND, "every Secret and ConfigMap the spec names exists (1)")
    assert ("Normal", references.FOUND, found["message"]) in events_for({"conditions": [missing]}, {}, [found])
