"""Status merge patches checked against the status models the CRD is generated from: the API server silently
prunes a key its schema lacks, so every status write goes through checked_patch (refresh.write_status) first."""

from __future__ import annotations

import functools
import json
import logging
import os
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from kvpersist.api.statusmodels import KVCacheNamespaceStatus

# An invalid patch raises (StatusPatchError) instead of being trimmed: set by the unit tests
# (tests/unit/conftest.py), or for a whole operator process with KVPERSIST_STRICT_STATUS=1.
STRICT = False
STRICT_ENV = "KVPERSIST_STRICT_STATUS"


def merge_patch(old: Any, new: Any) -> Any:
    """new as a JSON merge patch over old: every key old has and new lacks, at any depth, sent as
    null (a merge patch keeps what it does not name)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return new
    return {**{k: None for k in old if k not in new}, **{k: merge_patch(old.get(k), v) for k, v in new.items()}}


def field_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """One status field (a record kept whole) as a merge patch over old; None when nothing changed."""
    if new is None or dict(new) == dict(old or {}):
        return None
    return merge_patch(old or {}, new)


class StatusPatchError(ValueError):
    """A status patch that does not fit the status models; problems name each key."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("status patch does not fit the status models: " + "; ".join(problems))
        self.problems = problems


@functools.cache
def _fields(model: type[BaseModel]) -> dict[str, tuple[str, FieldInfo]]:
    """A model's fields by the key the API stores (the alias): the Python name is no status key."""
    return {info.alias or name: (name, info) for name, info in model.model_fields.items()}


@functools.cache
def _adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    """Validates one field's value with its type and constraints (length, pattern, range)."""
    info = model.model_fields[name]
    return TypeAdapter(Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model of a `Model` or `Model | None` field (a nested object, merged key by key)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _model_of(args[0])
    return None


def _loc(loc: tuple[Any, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)


def _problems(model: type[BaseModel], patch: Mapping[str, Any], path: str) -> list[str]:
    """What in a merge patch of model does not fit it: a nested object is merged (so checked) key by
    key and may leave required fields out; a list replaces the stored one, so is validated whole;
    None removes a field, so only an optional one. Values are checked strictly as JSON: "5" is no integer."""
    fields = _fields(model)
    out = []
    for key, value in patch.items():
        where = f"{path}.{key}"
        if key not in fields:
            out.append(f"{where}: {model.__name__} has no field {key!r} (it has {', '.join(sorted(fields))})")
            continue
        name, info = fields[key]
        if value is None:
            if info.is_required():
                out.append(f"{where}: required in {model.__name__}, so it cannot be removed (null)")
        elif (nested := _model_of(info.annotation)) is not None and isinstance(value, Mapping):
            out += _problems(nested, value, where)
        else:
            try:
                _adapter(model, name).validate_json(json.dumps(value), strict=True)
            except (TypeError, ValueError) as exc:  # ValidationError is a ValueError; TypeError: not JSON
                errors = exc.errors() if isinstance(exc, ValidationError) else [{"loc": (), "msg": str(exc)}]
                out += [f"{where}{_loc(tuple(e['loc']))}: {e['msg']}" for e in errors]
    return out


def validate_patch(patch: Mapping[str, Any]) -> None:
    """Raises StatusPatchError unless every key and value of the patch (under `status`) fits the models."""
    if problems := _problems(KVCacheNamespaceStatus, patch, "status"):
        raise StatusPatchError(problems)


def checked_patch(patch: Mapping[str, Any], logger: logging.Logger, what: str = "") -> dict[str, Any] | None:
    """The part of a status patch to send: all of it when it fits the status models; else, when strict
    (STRICT or STRICT_ENV), StatusPatchError. In production the status loop must go on: each top-level
    field with a problem is logged and left out whole (half an object could lack a required field and
    have the whole patch refused), the rest sent; None when nothing is left."""
    if STRICT or os.environ.get(STRICT_ENV) == "1":
        validate_patch(patch)
        return dict(patch)
    sent: dict[str, Any] = {}
    for key, value in patch.items():
        if problems := _problems(KVCacheNamespaceStatus, {key: value}, "status"):
            logger.error("%sstatus.%s left out of the status patch, it does not fit the CRD: %s",
                         f"{what}: " if what else "", key, "; ".join(problems))
        else:
            sent[key] = value
    return sent or None
