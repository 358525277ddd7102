"""The controller: the kopf handlers and the status loop (handlers), what the operator remembers
(state: a ResourceState per resource, owned by one Controller, forgotten in one step), the
decisions they act on (retry, fallback, policy, the runtime build check, stale routes), which
replica is active (leadership), the API server (kube) and the operator's metrics. It renders with
kvpersist.builders and reads through kvpersist.status and kvpersist.inventory.
"""
