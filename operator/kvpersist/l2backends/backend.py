"""What every L2 backend (a member of spec.l2's union) answers, so the builders and the controller ask it
instead of testing which member is set. The runtime half (inventory, preflight, cleanup) calls the
Kubernetes and storage clients, a layer above: kvpersist.controller.l2runtime, keyed alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic.alias_generators import to_snake

from kvpersist.api.spec import L2, SecretKeyRef
from kvpersist.builders.target import Target


def lmcache_number(value: float) -> str:
    """A number as lmcache's flags and backend_params take it: no fraction when whole."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class L2Backend:
    """One L2 backend. The defaults are a remote store's: nothing mounted, no Secret, reachable from anywhere."""

    field = ""  # spec.l2's member as the API spells it (L2.kind): the registry's key
    namespaced = False  # its store is an object of the resource's namespace (StorageInUse looks only there)
    adapter = ""  # lmcache's adapter, as L2Ready names it
    mounts_volume = False  # the servers and agents mount L2 (claims to check, a folder for the agent to read)
    secret_effects: tuple[tuple[str, str], ...] = ()  # (field, what it stops when missing) of secrets() (ReferencesFound)

    def settings(self, l2: L2) -> Any:
        return getattr(l2, to_snake(self.field))

    def adapter_config(self, target: Target, eviction: dict[str, Any], io_workers: int) -> dict[str, Any]:
        """lmcache's --l2-adapter JSON but the serde; eviction: the spec's, to adjust or embed."""
        raise NotImplementedError

    def server_env(self, target: Target) -> list[dict[str, Any]]:
        return []

    def agent_args(self, target: Target) -> list[str]:
        """The inventory agent's arguments for this store, after its common ones."""
        return []

    def secrets(self, l2: L2) -> list[tuple[str, SecretKeyRef]]:
        """The Secrets the spec names for it, by field (status.references, creator rights)."""
        return []

    def store(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """What identifies the store (controller.sharing.User's fields), from the stored spec's member."""
        raise NotImplementedError
