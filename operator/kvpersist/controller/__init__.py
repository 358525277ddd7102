"""The controller: the kopf handlers, one module per role (runtime: the one Controller and kopf's
settings; reading; drift; indexes: the watch caches; apply; refresh: one resource's status, with
its parts agents, bucketcheck, retention and transitions; gc; tracking; reconcile; status_loop),
registered by importing handlers; what the operator remembers (state: a ResourceState per
resource, owned by one Controller, forgotten in one step), the decisions they act on (retry,
fallback, policy, the runtime build check, stale routes), which replica is active (runtime),
the API server (kube) and the operator's metrics. It renders with kvpersist.builders and reads
through kvpersist.status and kvpersist.inventory.
"""
