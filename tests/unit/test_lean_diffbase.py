"""The operator's kopf diff base (runtime.LeanDiffBase) keeps exactly kopf's essence of a resource
while copying only what it keeps (issue 46: kopf deep-copied the whole body, status included, on
every event). Equal essences mean the last-handled-configuration annotations that kopf wrote
before compare equal after an upgrade: no spurious update of every resource."""

from __future__ import annotations

import copy

import kopf
import pytest

from kvpersist.controller.runtime import PREFIX, LeanDiffBase
from tests.cases.invalid_manifests import sample


def stored(annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None) -> dict:
    obj = copy.deepcopy(sample("hf-bucket"))
    obj["metadata"].update(namespace="ml", name="r", uid="u", generation=3, resourceVersion="9",
                           managedFields=[{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}])
    if annotations is not None:
        obj["metadata"]["annotations"] = annotations
    if labels is not None:
        obj["metadata"]["labels"] = labels
    obj["status"] = {"phase": "Ready", "conditions": [{"type": "Ready", "status": "True"}], "namespaceId": "kvp-" + "a" * 32}
    return obj


@pytest.mark.parametrize("body", [
    stored(),
    stored(annotations={}, labels={}),
    stored(annotations={"team": "ml", f"{PREFIX}/last-handled-configuration": "{}", "other.kopf.dev/x": "1",
                        "kubectl.kubernetes.io/last-applied-configuration": "{...}"}, labels={"app": "x"}),
])
def test_the_same_essence_as_kopfs_own(body: dict) -> None:
    kopfs = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX, key="last-handled-configuration")
    lean = LeanDiffBase(prefix=PREFIX, key="last-handled-configuration")
    assert lean.build(body=kopf.Body(body)) == kopfs.build(body=kopf.Body(body))
    for extra in (["status.phase"], [("spec",)], ["spec.l1"], [("metadata", "labels")]):  # ("spec",): the reconcile handler's
        assert lean.build(body=kopf.Body(body), extra_fields=extra) == kopfs.build(body=kopf.Body(body), extra_fields=extra)


def test_only_the_event_handlers_success_lines_are_dropped() -> None:
    """kopf's "Handler 'track' succeeded." for every watch event (thousands a minute at 500
    resources) goes; the reconcile handler's, failures and everything else stay."""
    import logging

    from kvpersist.controller.runtime import _EventHandlerSuccess

    keep = _EventHandlerSuccess().filter

    def record(msg: str, level: int = logging.INFO) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, __file__, 1, msg, None, None)

    assert not keep(record("Handler 'track' succeeded."))
    assert not keep(record("Handler 'drift' succeeded."))
    assert keep(record("Handler 'reconcile' succeeded."))
    assert keep(record("Handler 'track' failed with an exception. Will retry.", logging.ERROR))
    assert keep(record("ml/r: generated L2 master key Secret r-l2-key (fingerprint 0)"))
