"""kvpersist: a Kubernetes operator for a persistent, identity-namespaced vLLM KV cache."""

__version__ = "0.1.0"
