"""Whether the creator-rights policy exists and is bound (kvpersist.status.creatorrights judges), by the
install's name (KVPERSIST_CREATOR_RIGHTS_POLICY; `off`: no check), from watch caches of the two objects."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

from kvpersist.controller import kube, metrics, runtime
from kvpersist.controller.watchcache import WatchCache, list_and_watch
from kvpersist.status import Verdict, creatorrights

POLICY_ENV = "KVPERSIST_CREATOR_RIGHTS_POLICY"
DEFAULT_POLICY = "kvpersist-creator-rights"
API = "admissionregistration.k8s.io/v1"
POLL_S = 2.0  # how often the caches are judged again (no request: they are in memory)
log = logging.getLogger("kvpersist")


def policy_name(environ: Mapping[str, str]) -> str | None:
    """The policy's name to check, None when the check is off."""
    name = (environ.get(POLICY_ENV) or DEFAULT_POLICY).strip()
    return None if name.lower() == "off" else name


def _by_name(kind: str, name: str) -> WatchCache:
    """One object of a cluster-scoped kind, by name: a list and a watch field-selected to it."""
    return WatchCache(kind, None, *list_and_watch(API, kind, False, field_selector=f"metadata.name={name}"), keep=dict)


def verdict_of(name: str, policies: WatchCache, bindings: WatchCache, failing: str | None) -> Verdict | None:
    """The verdict from the caches; None while they have not listed (and nothing failed)."""
    synced_p, policy = policies.lookup("", name)
    synced_b, binding = bindings.lookup("", name)
    if synced_p and synced_b:
        return creatorrights.judge(name, True, policy, binding)
    if failing is not None:
        return creatorrights.judge(name, True, None, None, refused=failing)
    return None


def _post_operator_event(verdict: Verdict) -> None:
    """A Warning (or Normal, once enforced) Event on the operator's own pod, where it may post one."""
    pod, namespace = os.environ.get("POD_ID"), os.environ.get("KVPERSIST_OPERATOR_NAMESPACE")
    if not pod or not namespace or verdict[0] is None:
        return
    watched = runtime.CONTROLLER.peering["namespaces"]
    if watched and namespace not in watched:  # watchNamespaces without its own: no right there (the log and gauge say it)
        return
    owner = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": pod, "namespace": namespace, "uid": os.environ.get("POD_UID", "")}}
    kube.post_event(owner, "Normal" if verdict[0] else "Warning", verdict[1], verdict[2])  # best effort: it logs a refusal


def observe(verdict: Verdict) -> bool:
    """Keeps a new verdict; True when it changed (logged, posted, every resource marked)."""
    old = runtime.CONTROLLER.creator_rights
    if old == verdict:
        return False
    runtime.CONTROLLER.creator_rights = verdict
    metrics.creator_rights(verdict[0])
    if old is not None and old[:2] == verdict[:2]:
        return True  # the message only: the conditions follow at their next round
    (log.info if verdict[0] else log.warning)("creator-rights policy: %s: %s", verdict[1], verdict[2])
    _post_operator_event(verdict)
    for state in runtime.CONTROLLER.known().values():
        state.dirty = True
    return True


def start(environ: Mapping[str, str]) -> threading.Event | None:
    """The check's caches and thread (daemons); the Event that stops them, None when the check is off."""
    name = policy_name(environ)
    if name is None:
        log.info("%s=off: the creator-rights policy is not checked", POLICY_ENV)
        return None
    stop = threading.Event()

    def run() -> None:
        is_served: bool | None = None
        while is_served is None and not stop.is_set():
            try:
                is_served = kube.served(API, "ValidatingAdmissionPolicy")
            except Exception as exc:  # the API server unreachable at start: tried again
                log.debug("creator-rights check: discovery failed: %s", exc)
                stop.wait(POLL_S * 5)
        if stop.is_set():
            return
        if not is_served:
            observe(creatorrights.judge(name, False, None, None))
            return
        policies = _by_name("ValidatingAdmissionPolicy", name)
        bindings = _by_name("ValidatingAdmissionPolicyBinding", name)
        policies.start()
        bindings.start()
        waited = 0.0
        while not stop.wait(POLL_S):
            waited += POLL_S
            # Not listed after a minute: the operator may not read them (or the API server fails).
            verdict = verdict_of(name, policies, bindings, "not listed within a minute: may the operator list and watch "
                                 "them by name?" if waited >= 60 else None)
            try:
                if verdict is not None:
                    observe(verdict)
            except Exception as exc:  # an Event or a log that failed: the next round tries no less
                log.warning("creator-rights check: %s", exc)
        policies.stop()
        bindings.stop()

    threading.Thread(target=run, name="kvpersist-creator-rights-check", daemon=True).start()
    return stop
