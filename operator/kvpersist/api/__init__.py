"""The KVCacheNamespace API (models, CRD generation)."""
