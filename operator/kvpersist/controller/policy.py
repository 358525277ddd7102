"""What a KVCacheNamespace may ask of the cluster beyond its schema: the images its pods run
(the chart's allowedImages) and the Secrets it may name (the chart's secretLabel).

Why: the operator runs with more rights than whoever creates a KVCacheNamespace. Without these,
creating one runs any image on GPU nodes, with any Secret of the namespace mounted into it or in
its environment: a Secret its author may not be allowed to read. Pure (docs/security.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.builders.lmcache import OPERATOR_NAMESPACE_ENV, SCRAPER_ENV, parse_scraper
from kvpersist.status import references
from kvpersist.status.conditions import condition

ALLOWED_IMAGES_ENV = "KVPERSIST_ALLOWED_IMAGES"
SECRET_LABEL_ENV = "KVPERSIST_SECRET_LABEL"
CLUSTER_DOMAIN_ENV = "KVPERSIST_CLUSTER_DOMAIN"
RESOLV_CONF = Path("/etc/resolv.conf")
IMAGE_NOT_ALLOWED = "ImageNotAllowed"
SECRET_NOT_ALLOWED = "SecretNotAllowed"
REASONS = (IMAGE_NOT_ALLOWED, SECRET_NOT_ALLOWED)
UNTOUCHED = "nothing was applied for this generation; existing workloads are left as they are"

_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
LABEL_KEY_RE = re.compile(rf"^({_DNS_SUBDOMAIN}/)?{_LABEL_NAME}$")
LABEL_VALUE_RE = re.compile(rf"^({_LABEL_NAME})?$")
# Only the first path component can name a registry: it has a dot or a port, or is localhost.
_REGISTRY_RE = re.compile(r"^(localhost|[^/]*[.:][^/]*)$")
_BOUNDARY_CHARS = ("/", ":", "@")

Refusal = tuple[str, str]  # (reason, message), as conditions carry them


def parse_allowed_images(raw: str) -> tuple[str, ...]:
    """The prefixes of KVPERSIST_ALLOWED_IMAGES: separated by commas or whitespace; empty: any image."""
    prefixes = tuple(p for p in re.split(r"[,\s]+", raw.strip()) if p)
    for p in prefixes:
        if p.startswith(("/", ":", "@")) or len(p) > 512:
            raise ValueError(f"{ALLOWED_IMAGES_ENV}: {p!r} is not an image prefix: write a registry, a repository or a "
                             "full reference, e.g. registry.example.com/lmcache/ (chart value allowedImages)")
    return prefixes


def parse_secret_label(raw: str) -> tuple[str, str] | None:
    """KVPERSIST_SECRET_LABEL as (key, value): `key=value`; empty: no label required."""
    raw = raw.strip()
    if not raw:
        return None
    key, eq, value = raw.partition("=")
    prefix_len = len(key.rpartition("/")[0])
    if not eq or not LABEL_KEY_RE.match(key) or not LABEL_VALUE_RE.match(value) or len(key) - prefix_len > 64 \
            or prefix_len > 253 or len(value) > 63:
        raise ValueError(f"{SECRET_LABEL_ENV}: {raw!r} is not a label: write key=value, e.g. "
                         "kvpersist.dev/usable-by=kvpersist (chart value secretLabel)")
    return key, value


def parse_cluster_domain(raw: str) -> str:
    """KVPERSIST_CLUSTER_DOMAIN (the chart's clusterDomain): a DNS name, a trailing dot allowed."""
    domain = raw.strip().lower().removesuffix(".")
    if not re.fullmatch(_DNS_SUBDOMAIN, domain) or len(domain) > 253 or any(len(p) > 63 for p in domain.split(".")):
        raise ValueError(f"{CLUSTER_DOMAIN_ENV}: {raw!r} is not a DNS domain: write the cluster's domain, the kubelet's "
                         "--cluster-domain, e.g. cluster.local (chart value clusterDomain)")
    return domain


def domain_in_resolv_conf(text: str) -> str | None:
    """The cluster domain as the kubelet wrote it into this pod's search list (<ns>.svc.<domain>
    svc.<domain> <domain>), or None outside a pod with cluster DNS."""
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["search"]:
            for entry in words[1:]:
                if entry.startswith("svc.") and len(entry) > 4:
                    return parse_cluster_domain(entry[4:])
    return None


def read_cluster_domain(environ: Mapping[str, str], resolv_conf: Path | None = None) -> str | None:
    """The chart's clusterDomain, else the one this pod's resolver was given, else None (unknown)."""
    if environ.get(CLUSTER_DOMAIN_ENV, "").strip():
        return parse_cluster_domain(environ[CLUSTER_DOMAIN_ENV])
    try:
        return domain_in_resolv_conf((resolv_conf or RESOLV_CONF).read_text(errors="replace")[:65536])
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Policy:
    """The operator's admission policy for KVCacheNamespaces, from its environment (the chart)."""

    allowed_images: tuple[str, ...] = ()  # empty: any image
    secret_label: tuple[str, str] | None = None  # None: any Secret the resource names
    # The DNS domain of the cluster's Services: vLLM reaches its server at an absolute name
    # (<service>.<ns>.svc.<domain>.), which no search list entry can capture (builders.vllm).
    cluster_domain: str | None = None  # None: unknown (`kvpersist run` refuses to start)
    # Who may reach the agents' port: the operator's own pods in its namespace, and the chart's
    # metrics.scraper (builders.lmcache). Read here, once, so decide reads no environment.
    operator_namespace: str | None = None
    metrics_scraper: Mapping[str, Any] | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str], resolv_conf: Path | None = None) -> Policy:
        """Raises ValueError naming the variable and the fix when one is malformed."""
        return cls(parse_allowed_images(environ.get(ALLOWED_IMAGES_ENV, "")),
                   parse_secret_label(environ.get(SECRET_LABEL_ENV, "")), read_cluster_domain(environ, resolv_conf),
                   environ.get(OPERATOR_NAMESPACE_ENV) or None, parse_scraper(environ.get(SCRAPER_ENV, "")))

    def generated_secret_labels(self) -> dict[str, str]:
        """The required label, on the operator's own Secrets too, so they are usable under the same rule."""
        return dict([self.secret_label]) if self.secret_label else {}


def canonical_image(reference: str) -> str:
    """The reference with Docker Hub's implied parts spelled out, as container runtimes read it:
    vllm/vllm-openai:v1 is docker.io/vllm/vllm-openai:v1, ubuntu is docker.io/library/ubuntu."""
    first, slash, rest = reference.partition("/")
    if not slash:
        return f"docker.io/library/{reference}"
    if first in ("docker.io", "index.docker.io"):
        return f"docker.io/{rest}" if "/" in rest else f"docker.io/library/{rest}"
    if _REGISTRY_RE.match(first):
        return reference
    return f"docker.io/{reference}"


def _has_prefix(reference: str, prefix: str) -> bool:
    """Prefix match on whole components: a prefix ending in /, : or @ matches any reference starting
    with it; else the reference equals it or goes on with /, : or @ (only / after a bare registry
    host, whose : would start a port, another registry)."""
    if prefix.endswith(_BOUNDARY_CHARS):
        return reference.startswith(prefix)
    if reference == prefix:
        return True
    if not reference.startswith(prefix):
        return False
    boundaries = _BOUNDARY_CHARS if "/" in prefix else ("/",)
    return reference[len(prefix)] in boundaries


def image_allowed(reference: str, prefixes: tuple[str, ...]) -> bool:
    """Whether an image reference falls under one of the prefixes (none: any image). Compared as
    written and in its canonical form, so docker.io/vllm/ admits vllm/vllm-openai too."""
    if not prefixes:
        return True
    ref = reference.strip()
    forms = {ref, canonical_image(ref)}
    return any(_has_prefix(form, prefix) for form in forms for prefix in prefixes)


def image_refusal(spec: KVCacheNamespaceSpec, prefixes: tuple[str, ...]) -> Refusal | None:
    """ImageNotAllowed for spec.image when no prefix admits it, else None."""
    if image_allowed(spec.image, prefixes):
        return None
    shown = ", ".join(prefixes)
    if len(shown) > 1500:
        shown = shown[:1500] + ", ..."
    return IMAGE_NOT_ALLOWED, (
        f"spec.image: image {spec.image} matches none of the image prefixes this operator allows ({shown}): use an "
        f"image under one of them, or ask the operator's admin to add its registry or repository to the chart "
        f"value allowedImages; {UNTOUCHED}")


def named_secrets(spec: KVCacheNamespaceSpec) -> list[tuple[str, str]]:
    """The Secrets a user named, as (field, Secret name): what the label rule applies to (never the
    operator's own). One list with the ConfigMaps ReferencesFound checks (references.named)."""
    return [(ref.field, ref.name) for ref in references.named(spec) if ref.kind == references.SECRET]


def secret_refusal(field: str, name: str, namespace: str, metadata: Mapping[str, Any] | None,
                   label: tuple[str, str] | None) -> Refusal | None:
    """SecretNotAllowed when a label is required and the Secret (its metadata; None: absent) lacks it or
    does not exist (one made later, by someone else, must not be used unchecked), else None."""
    if label is None:
        return None
    key, value = label
    text = f"{key}={value}"
    where = f"{field}: Secret {name} in namespace {namespace}"
    if metadata is None:
        return SECRET_NOT_ALLOWED, (f"{where} does not exist, and this operator uses only Secrets labelled {text}: "
                                    f"create it, then label it (kubectl label secret {name} -n {namespace} {text}); {UNTOUCHED}")
    if (metadata.get("labels") or {}).get(key) != value:
        return SECRET_NOT_ALLOWED, (f"{where} lacks the label {text}, which this operator requires of every Secret a "
                                    f"KVCacheNamespace names: whoever may read the Secret labels it (kubectl label secret "
                                    f"{name} -n {namespace} {text}), or name another Secret; {UNTOUCHED}")
    return None


def refused_status(fields: Mapping[str, Any], conds: list[dict[str, Any]], refusal: Refusal,
                   generation: int | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The status of a refused resource: phase Failed and Ready False with the refusal's reason; a
    refused Secret is L2's problem too (L2Ready says so)."""
    reason, message = refusal
    out = [c for c in conds if c["type"] != "Ready"]
    if reason == SECRET_NOT_ALLOWED:
        out = [condition("L2Ready", False, reason, message, generation) if c["type"] == "L2Ready" else c for c in out]
    return {**fields, "phase": "Failed"}, [*out, condition("Ready", False, reason, message, generation)]
