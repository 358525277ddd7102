"""Pure builders: a KVCacheNamespace spec in, Kubernetes manifests (plain dicts) out.

Nothing here talks to the API server, so every rendered field is unit-tested without a cluster.
"""
