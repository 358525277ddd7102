"""The creator-rights policy without a cluster: the chart ships the same objects as
config/creator-rights, and the policy checks every Secret and claim the API lets a spec name. The
API server's side (two users) is tests/e2e/test_creator_rights.py."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from kvpersist.api.spec import (
    VLLM,
    APIKeySecretRef,
    EnvFromSource,
    HFTokenSecretRef,
    KeySecretRef,
    KVCacheNamespaceSpec,
    LMCacheServer,
    LocalObjectRef,
    SecretKeyRef,
    VLLMService,
)
from kvpersist.builders.target import Target
from kvpersist.controller.ownership import l2_claim_names

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config/creator-rights/creator-rights.yaml"
TEMPLATE = ROOT / "charts/kvpersist/templates/creator-rights.yaml"


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_chart_ships_the_same_creator_rights_policy_as_config() -> None:
    """The chart's template, rendered for release "kvpersist" (helm's own rendering is checked by
    tests/e2e/test_helm.py), equals the plain manifest apart from the chart's labels; on by default."""
    template = TEMPLATE.read_text()
    assert "{{- if .Values.creatorRights.enabled }}" in template
    assert yaml.safe_load((ROOT / "charts/kvpersist/values.yaml").read_text())["creatorRights"]["enabled"] is True
    rendered = re.sub(r"\{\{-? (if|end)[^}]*\}\}\n?", "", template)
    rendered = re.sub(r"\n *labels: \{\{-[^}]*\}\}", "", rendered)
    rendered = rendered.replace('{{ include "kvpersist.fullname" . }}', "kvpersist")
    rendered = rendered.replace('{{- include "kvpersist.bindingScope" . }}\n', "")  # empty without watchNamespaces
    assert "{{" not in rendered
    plain = _docs(CONFIG.read_text())
    assert _docs(rendered) == plain
    assert [d["kind"] for d in plain] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    assert plain[1]["spec"] == {"policyName": "kvpersist-creator-rights", "validationActions": ["Deny"]}
    rules = plain[0]["spec"]["matchConstraints"]["resourceRules"]
    # The main resource only: status is a subresource (the operator's writes), never matched.
    assert rules == [{"apiGroups": ["kvpersist.dev"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
                      "resources": ["kvcachenamespaces"]}]
    assert plain[0]["spec"]["failurePolicy"] == "Fail"


def _types(annotation: Any) -> list[Any]:
    """The annotation and every type inside it (unions, lists, dicts)."""
    return [annotation, *(t for arg in typing.get_args(annotation) for t in _types(arg))]


SECRET_REFS = (SecretKeyRef, KeySecretRef, HFTokenSecretRef, APIKeySecretRef)


def _refs(model: type[BaseModel], path: str) -> list[tuple[str, str]]:
    """(kind, spec path) of every Secret, ConfigMap and claim a spec can name, found by walking the
    models, so a field added later is found too; `[]` marks a list's entries."""
    out: list[tuple[str, str]] = []
    for name, field in model.model_fields.items():
        here = f"{path}.{field.alias or name}"
        if typing.get_origin(field.annotation) is list:
            here += "[]"
        if name == "existing_claim_name":
            out.append(("claim", here))
        for arg in _types(field.annotation):
            if arg in SECRET_REFS:
                out.append(("secret", here + ".name"))
            elif arg is LocalObjectRef:
                kind = {"config_map_ref": "configmap"}.get(name, "secret")
                out.append((kind, here + ".name"))
            elif isinstance(arg, type) and issubclass(arg, BaseModel):
                out += _refs(arg, here)
    return out


def test_every_secret_and_claim_a_spec_can_name_is_checked_by_name() -> None:
    """Each reference the API has is read by the policy and checked with the authorizer for get,
    by name, on its kind; each has its own refusal naming the field."""
    policy = _docs(CONFIG.read_text())[0]["spec"]
    variables = {v["name"]: v["expression"] for v in policy["variables"]}
    refs = _refs(KVCacheNamespaceSpec, "spec")
    assert sorted(refs) == [("claim", "spec.l2.nvme.existingClaimName"), ("claim", "spec.vllm.modelCache.existingClaimName"),
                            ("configmap", "spec.prewarm.configMapRef.name"),
                            ("configmap", "spec.vllm.envFrom[].configMapRef.name"), ("secret", "spec.imagePullSecrets[].name"),
                            ("secret", "spec.l2.encryption.keySecretRef.name"),
                            ("secret", "spec.l2.hfBucket.tokenSecretRef.name"),
                            ("secret", "spec.vllm.apiKeySecretRef.name"), ("secret", "spec.vllm.envFrom[].secretRef.name"),
                            ("secret", "spec.vllm.hfTokenSecretRef.name")]
    messages = [v.get("messageExpression", "") for v in policy["validations"]]
    for kind, path in refs:
        if "[]" in path:
            continue
        var = next(n for n, e in variables.items() if f"string(object.{path})" in e)
        check = next(e for e in variables.values() if f".name(variables.{var}).check('get').allowed()" in e)
        resource = {"claim": "persistentvolumeclaims", "configmap": "configmaps"}.get(kind, "secrets")
        assert f"resource('{resource}')" in check and check.startswith("!variables.changed ||"), check
        assert any(f"'{path} names " in m for m in messages), path
    # A list's entries, each by index up to the API's cap (one authorizer check per expression: a
    # check's cost allows few in one), each checked for get on its own kind.
    caps = {"spec.imagePullSecrets": KVCacheNamespaceSpec.model_fields["image_pull_secrets"],
            "spec.vllm.envFrom": VLLM.model_fields["env_from"]}
    for path, field in caps.items():
        cap = next(m.max_length for m in field.metadata if hasattr(m, "max_length"))
        for i in range(cap):
            reads = [n for n, e in variables.items() if f"object.{path}[{i}]" in e]
            assert reads, f"{path}[{i}] is not read by the policy"
            assert any(f".name(variables.{n}" in e and "check('get')" in e and e.startswith("!variables.changed ||")
                       for n in reads for e in variables.values()), f"{path}[{i}]"
        assert not any(f"object.{path}[{cap}]" in e for e in variables.values())
        assert any(f"'{path} names " in m for m in messages), path
    assert set(EnvFromSource.model_fields) == {"secret_ref", "config_map_ref"}
    envfrom = " ".join(e for n, e in variables.items() if n.startswith("envFrom"))
    assert "['secrets', string(object.spec.vllm.envFrom[0].secretRef.name)]" in envfrom
    assert "['configmaps', string(object.spec.vllm.envFrom[0].configMapRef.name)]" in envfrom
    pods = variables["podsAllowed"]
    assert "resource('pods')" in pods and "check('create')" in pods
    assert variables["changed"] == "oldObject == null || object.spec != oldObject.spec"
    # Every check is a validation: pods last, so a field's refusal names the field.
    checks = [v["expression"].strip() for v in policy["validations"]]
    assert checks == ["variables.tokenSecretAllowed", "variables.keySecretAllowed", "variables.claimAllowed",
                      "variables.hfTokenSecretAllowed", "variables.apiKeySecretAllowed", "variables.modelClaimAllowed",
                      "variables.modelClaimMadeAllowed", "size(variables.envFromDenied) == 0",
                      "size(variables.pullSecretsDenied) == 0", "variables.prewarmConfigMapAllowed",
                      "variables.generatedKeyAllowed", "variables.sharedClaimAllowed", "variables.serverClaimsAllowed",
                      "variables.l2ClaimsMadeAllowed", "variables.externalServiceAllowed", "variables.inferencePoolAllowed",
                      "variables.pdbAllowed", "variables.podsAllowed"]
    assert all("variables.user" in m and "kubectl create rolebinding" in m for m in messages)


def test_what_the_operator_makes_for_every_spec_needs_its_authors_right() -> None:
    """Issue 58 item 4: every object kind the builders make for a resource is one its author must
    be allowed to create: pods (the servers' and vLLM's), the servers' PodDisruptionBudget (one that
    cannot be met blocks every drain of their nodes) and, with spec.vllm.inferencePool, the
    InferencePool a Gateway routes through; each with its own refusal and the line that grants it."""
    policy = _docs(CONFIG.read_text())[0]["spec"]
    variables = {v["name"]: v["expression"] for v in policy["variables"]}
    asked = {"pods": ("''", "podsAllowed"), "poddisruptionbudgets": ("'policy'", "pdbAllowed"),
             "inferencepools": ("'inference.networking.k8s.io'", "inferencePoolAllowed")}
    for resource, (group, var) in asked.items():
        check = variables[var]
        assert f"authorizer.group({group}).resource('{resource}')" in check and "check('create')" in check, check
        assert f"create on {resource}" in variables["needs"], resource
    assert "!variables.inferencePool" in variables["inferencePoolAllowed"]
    assert variables["inferencePool"] == "has(object.spec.vllm) && has(object.spec.vllm.inferencePool)"
    messages = {v["expression"]: v["messageExpression"] for v in policy["validations"]}
    assert "--resource=poddisruptionbudgets.policy" in messages["variables.pdbAllowed"]
    assert "--resource=inferencepools.inference.networking.k8s.io" in messages["variables.inferencePoolAllowed"]
    # And what the builders make is exactly what the policy asks for (a new kind must be asked for too).
    from kvpersist.builders.all import build_all
    from tests.unit.test_builders import target

    made = {m["kind"] for m in build_all(dataclasses.replace(target(), inference_pool_served=True))}
    asked_kinds = {"Pod", "PodDisruptionBudget", "InferencePool", "StatefulSet", "Deployment", "Service", "NetworkPolicy",
                   "ConfigMap", "PersistentVolumeClaim", "Secret"}
    assert made <= asked_kinds, made - asked_kinds


def test_a_claim_the_operator_makes_needs_its_author_to_be_allowed_to_create_claims() -> None:
    """spec.vllm.modelCache.size makes the operator create a claim in the namespace: the policy
    asks the authorizer whether the author may create PersistentVolumeClaims there (only then, and
    only when the spec changed), and its refusal names the field and the line that grants it. The
    user's-claim form is read only when set (existingClaimName is optional now: reading it unset
    would be a CEL error, which failurePolicy Fail turns into a refusal of every size form)."""
    policy = _docs(CONFIG.read_text())[0]["spec"]
    variables = {v["name"]: v["expression"] for v in policy["variables"]}
    made = variables["modelClaimMade"]
    assert "has(object.spec.vllm.modelCache.size)" in made
    check = variables["modelClaimMadeAllowed"]
    assert check.startswith("!variables.changed || !variables.modelClaimMade ||"), check
    assert "resource('persistentvolumeclaims').namespace(variables.ns).check('create').allowed()" in check
    assert "has(object.spec.vllm.modelCache.existingClaimName)" in variables["modelClaim"]
    [refusal] = [v for v in policy["validations"] if v["expression"].strip() == "variables.modelClaimMadeAllowed"]
    assert refusal["reason"] == "Forbidden" and refusal["message"].startswith("spec.vllm.modelCache.size ")
    assert "--verb=create --resource=persistentvolumeclaims" in refusal["messageExpression"]
    assert "'create on persistentvolumeclaims'" in variables["needs"]


def test_what_the_operator_makes_or_finds_for_a_spec_is_checked() -> None:
    """Issue 42: the names the policy computes are the operator's (a deleted namesake's key Secret
    and L2 claims are used by whoever re-creates the name: get on each), the per-server claims are
    checked by name up to the bound and by get on every claim above it (replicas allows more than
    one expression's checks fit), and an external Service or L2 claims made need create."""
    policy = _docs(CONFIG.read_text())[0]["spec"]
    variables = {v["name"]: v["expression"] for v in policy["variables"]}
    obj = yaml.safe_load((ROOT / "config/samples/nvme-minimal.yaml").read_text())
    obj["spec"]["vllm"].pop("hfTokenSecretRef", None)
    obj["spec"].setdefault("lmcacheServer", {})["replicas"] = 3
    target = Target("res", "ns", KVCacheNamespaceSpec.model_validate(obj["spec"]), None)
    assert target.key_secret == ("res-l2-key", "master-key") and "variables.name + '-l2-key'" in variables["generatedKey"]
    assert l2_claim_names(target) == ["l2-res-lmcache-0", "l2-res-lmcache-1", "l2-res-lmcache-2"]
    assert "'l2-' + variables.name + '-lmcache-' + string(i)" in variables["serverClaimNames"]
    shared = Target("res", "ns", target.spec.model_copy(update={"l2": target.spec.l2.model_copy(update={
        "nvme": target.spec.l2.nvme.model_copy(update={"shared": True, "adapter": "nixl_store_dynamic"})})}), None)
    assert l2_claim_names(shared) == ["l2-res-lmcache-shared"] and "'l2-' + variables.name + '-lmcache-shared'" in variables[
        "sharedClaim"]
    bound = 8
    replicas = next(m.le for m in LMCacheServer.model_fields["replicas"].metadata if hasattr(m, "le"))
    assert replicas > bound and f"[{', '.join(map(str, range(bound)))}]" in variables["serverClaimNames"]
    for i in range(bound):
        check = variables[f"serverClaim{i}Allowed"]
        assert f"variables.serverClaims < {i + 1} || variables.serverClaims > {bound}" in check
        assert f".name(variables.serverClaimNames[{i}]).check('get')" in check and check.startswith("!variables.changed ||")
        assert f"variables.serverClaim{i}Allowed" in variables["serverClaimsAllowed"]
    above = variables["serverClaimsAnyAllowed"]
    assert f"variables.serverClaims <= {bound}" in above and ".namespace(variables.ns).check('get')" in above
    assert "variables.serverClaimsAnyAllowed" in variables["serverClaimsAllowed"]
    assert "resource('persistentvolumeclaims').namespace(variables.ns).check('create')" in variables["l2ClaimsMadeAllowed"]
    assert typing.get_args(VLLMService.model_fields["type"].annotation) == ("ClusterIP", "NodePort", "LoadBalancer")
    assert "object.spec.vllm.service.type != 'ClusterIP'" in variables["externalService"]
    assert "resource('services').namespace(variables.ns).check('create')" in variables["externalServiceAllowed"]
