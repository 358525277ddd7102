"""The kv-transfer-config that wires the operator's vLLM to its lmcache server. Published nowhere:
a client with it could write KV under other flags that the pinned pods then hit (docs/design.md,
"Who may write into a namespace")."""

from __future__ import annotations

import json
from typing import Any

from kvpersist.api.identity import CONNECTOR
from kvpersist.builders.target import Target

HEARTBEAT_INTERVAL_S = 2.0
CONNECTOR_MODULES = {"LMCacheMPConnector": "lmcache.integration.vllm.lmcache_mp_connector"}


def server_host(target: Target) -> str:
    """The node-local Service's absolute DNS name, which no search list can capture."""
    return f"{target.local_service_name}.{target.namespace}.svc.{target.cluster_domain}."


def kv_transfer_config(target: Target) -> dict[str, Any]:
    """The connector is pinned by module path, so vLLM cannot pick up another implementation."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULES[CONNECTOR],
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            # Absolute (the trailing dot): a relative name is tried against the search list first, where
            # <route>.<ns>.svc.svc.<domain> belongs to whoever owns a namespace named svc.
            "lmcache.mp.host": f"tcp://{server_host(target)}",
            "lmcache.mp.port": target.spec.lmcache_server.port,
            # vLLM notices a restarted server only by a failed heartbeat: a restart shorter than the
            # default 10 s goes unseen and the next cached request hangs 300 s and kills the engine
            # (seen with lmcache 0.5.6). A server takes several seconds to start: 2 s cannot miss one.
            "lmcache.mp.heartbeat_interval": HEARTBEAT_INTERVAL_S,
            # Must match the server's --isolated-ipc (builders/lmcache.server_args says why).
            "lmcache.mp.isolated_ipc": True,
        },
    }


def kv_transfer_config_json(target: Target) -> str:
    return json.dumps(kv_transfer_config(target), separators=(",", ":"), sort_keys=True)
