"""The bases of the KVCacheNamespace API's models (spec, status and the object, kvpersist.api.v1alpha1)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class APIModel(BaseModel):
    # protected_namespaces: identity.modelId is a field, not pydantic's (older pydantic warns on "model_").
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True,
                              protected_namespaces=())


class SpecPart(APIModel):
    """A part of spec: JSON's types as the API server's schema checks them, no coercion (pydantic's
    lax mode would take "5" or True for an integer, 1 for a boolean, which the API server refuses)."""

    model_config = ConfigDict(strict=True)


def list_field(max_length: int, description: str, *rules: dict[str, str]) -> Any:
    """A list that may be left out, stored as [] then; rules: CEL on the whole list."""
    extra: dict[str, Any] = {"default": [], "x-kubernetes-validations": list(rules)} if rules else {"default": []}
    return Field(default_factory=list, max_length=max_length, description=description, json_schema_extra=extra)
