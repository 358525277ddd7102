"""The inventory agents as a status refresh asks them: the resource's agent token and every agent's inventory."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from kvpersist.builders.target import AGENT_TOKEN_KEY, Target
from kvpersist.controller import kube, ownership, runtime
from kvpersist.controller.reading import secret_version
from kvpersist.httpclient import in_parallel
from kvpersist.inventory.agentclient import fetch_inventory
from kvpersist.inventory.volume import Inventory

AGENT_TOKEN_TTL_S = 300.0
TOKEN_REAPPLY_S = 15.0  # a missing token Secret is applied again at most this often


def agent_token(target: Target) -> str | None:
    """The resource's agent token, read at most every AGENT_TOKEN_TTL_S (and after a failed read). Never logged."""
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    cached = state.agent_token
    now = time.monotonic()
    synced, version = secret_version(target.namespace, target.agent_token_secret)
    if synced and version is None:  # the cache has listed and there is no such Secret: nothing to read
        state.agent_token, state.agent_token_version = (now, None), None
        return None
    if cached and cached[1] and (state.agent_token_version == version if synced else now - cached[0] < AGENT_TOKEN_TTL_S):
        return cached[1]
    try:
        secret = kube.get("v1", "Secret", target.agent_token_secret, target.namespace)
    except ApiException:
        secret = None
    return remember_token(target, secret, ((state.body or {}).get("metadata") or {}).get("uid"))


def remember_token(target: Target, secret: Mapping[str, Any] | None, owner_uid: str | None) -> str | None:
    """The token in the Secret as read, or as the apply created it (then never read back while the
    Secret watch cache shows that version), kept; None when there is none or the Secret is not the
    resource's own (owner_uid's). Never logged."""
    if secret is not None and not ownership.is_own_child(secret.get("metadata"), owner_uid):
        # Someone else's Secret under the token's name: never sent to the agents; the apply says NameTaken.
        runtime.CONTROLLER.child_owners.pop(("Secret", target.namespace, target.agent_token_secret), None)
        secret = None
    raw = kube.secret_value(secret, AGENT_TOKEN_KEY)
    token = raw.decode().strip() if raw else None
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    state.agent_token = (time.monotonic(), token)
    state.agent_token_version = ((secret or {}).get("metadata") or {}).get("resourceVersion")
    return token


def inventories(pods: list[tuple[str, str | None]], port: int, token: str | None) -> list[Inventory | None]:
    """Every agent's inventory, asked in parallel: the round costs one deadline however many agents are slow."""
    return in_parallel(lambda pi: fetch_inventory(pi[1], port, token=token) if pi[1] else None, pods, limit=16)
