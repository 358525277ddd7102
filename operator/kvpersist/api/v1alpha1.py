"""The KVCacheNamespace API, v1alpha1: the object, its group and version; the CRD is generated from it (its spec
kvpersist.api.spec, its status kvpersist.api.statusmodels)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from kvpersist.api import celrules
from kvpersist.api.celrules import cel
from kvpersist.api.models import APIModel
from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.api.statusmodels import KVCacheNamespaceStatus
from kvpersist.api.text import printable

GROUP = "kvpersist.dev"
VERSION = "v1alpha1"
KIND = "KVCacheNamespace"
PLURAL = "kvcachenamespaces"
SINGULAR = "kvcachenamespace"
SHORT_NAMES = ["kvns"]
API_VERSION = f"{GROUP}/{VERSION}"

# metadata.name prefixes every derived object's name (builders/target.py): a Service's is an RFC 1035 label
# (at most 63), the longest derivations add 17 (`NAME-lmcache-<8 hex>`) and 19 (the StatefulSet's
# controller-revision-hash label), so 44 at most; 40 keeps room for a longer suffix.
MAX_NAME_LENGTH = 40
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_RULE = (f"metadata.name: at most {MAX_NAME_LENGTH} characters, a lowercase letter first, then lowercase letters, "
             "digits and '-' (no '.'), ending with a letter or digit: it prefixes the names of the Services (RFC 1035 "
             "labels), pods, StatefulSet revision labels and ConfigMaps made for it, which Kubernetes would refuse later")


# The object's one rule above spec (the CRD's root, kvpersist.api.crd).
NAME_CEL = cel(f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')", NAME_RULE,
               reason="FieldValueInvalid")


class KVCacheNamespace(APIModel):
    """A KVCacheNamespace object as stored."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal[API_VERSION] = API_VERSION  # type: ignore[valid-type]
    kind: Literal[KIND] = KIND  # type: ignore[valid-type]
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: KVCacheNamespaceSpec
    status: KVCacheNamespaceStatus | None = None

    @model_validator(mode="after")
    def _name_fits_every_derived_name(self) -> KVCacheNamespace:
        """The CRD's rule on metadata.name (NAME_CEL), where the object has a name to judge."""
        name = self.metadata.get("name", "")
        if name and not celrules.holds(NAME_CEL["rule"], {"metadata": {"name": name}}):
            raise ValueError(f"{NAME_CEL['message']}; got {name!r} ({len(name)} characters)")
        return self


def validation_message(exc: ValidationError) -> str:
    """pydantic's errors as `path: message` lines, with the API's camelCase field paths."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        # printable: a path through a map key, or a message quoting input, may hold the very
        # character refused; the message goes into a condition and must not carry it.
        lines.append(printable(f"{path}: {msg}" if path else msg))
    return "; ".join(lines)
