"""Control and format characters in the spec's free strings, and a fuzz of every string and
quantity field (issue 29 item 7).

Until issue 29, spec.vllm.servedModelName, the images, extraArgs values, tolerations and node
selectors took any character: a bidi override (U+202E) that makes a name read as another, a NUL
or a newline that cuts argv and forges log lines, a zero-width space that makes two images look
alike. The models now refuse them naming the field, the character and its position; the CRD's
pattern (the same table, kvpersist.api.text) refuses them at `kubectl apply`, which
tests/e2e/test_api.py checks on the real API server, character by character.

The fuzz walks the generated schema, so a field added later is fuzzed without anyone listing it:
any value either validates, and then the operator's pure path from a spec to manifests renders it
without raising, or is a pydantic ValidationError naming that field; never another exception (out
of a handler, kopf would retry it forever and write no InvalidSpec).
"""

from __future__ import annotations

import copy
import itertools
import re
import unicodedata
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import Field, TypeAdapter, ValidationError

from kvpersist.api.crd import build_crd
from kvpersist.api.spec import QUANTITY
from kvpersist.api.text import FORBIDDEN, NO_CONTROL_PATTERN, PROMPT_PATTERN, SURROGATES, control_problem, printable
from kvpersist.api.v1alpha1 import KVCacheNamespace, validation_message
from kvpersist.builders.all import build_all
from kvpersist.builders.target import Target
from kvpersist.controller.policy import image_refusal, named_secrets
from kvpersist.identity import resolve
from tests.cases.invalid_manifests import sample
from tests.cases.oracles import forbidden

# ---------------------------------------------------------------- the table


def test_the_table_covers_every_control_format_and_separator_character_python_knows() -> None:
    """FORBIDDEN is written out (the API server's Go and this Python have other Unicode
    versions); it must hold every Cc, Cf, Zl, Zp (and surrogate) of Python's, and nothing but
    those or code points Python's older Unicode has not assigned yet (Unicode 15's U+13439-U+1343F)."""
    refused = {"Cc", "Cf", "Zl", "Zp", "Cs"}
    for c in range(0x110000):
        category = unicodedata.category(chr(c))
        assert forbidden(chr(c)) == (category in refused) or (forbidden(chr(c)) and category == "Cn"), \
            f"U+{c:04X} {category} {unicodedata.name(chr(c), '')}"


def _rust_pattern() -> TypeAdapter:
    """The schema's pattern under pydantic-core's Rust regex, which reads \\x{...} as RE2 does."""
    return TypeAdapter(Annotated[str, Field(pattern=NO_CONTROL_PATTERN)])


def test_the_schema_pattern_and_the_models_refuse_the_same_characters() -> None:
    """Every code point but the surrogates (which no JSON decoder hands the API server), between
    two letters: the pattern matches exactly when the models' check passes."""
    pattern = _rust_pattern()
    differ = []
    for c in range(0x110000):
        if SURROGATES[0] <= c <= SURROGATES[1]:
            continue
        value = f"a{chr(c)}b"
        try:
            pattern.validate_python(value)
            matched = True
        except ValidationError:
            matched = False
        if matched != (control_problem(value) is None):
            differ.append(f"U+{c:04X}")
    assert differ == []


def test_a_loose_pattern_is_told_from_a_strict_one() -> None:
    assert loose(".*") and loose("^[^/]+$") and loose(r"^\\S+$") and loose(r"^a(=.*)?$")
    assert not loose(r"^[A-Za-z0-9._-]+(\.[a-z]+)*$") and not loose(r"^sha256:[0-9a-f]{64}$")


def test_the_pattern_is_ascii_in_the_syntax_re2_and_rust_share() -> None:
    assert NO_CONTROL_PATTERN.isascii()
    assert NO_CONTROL_PATTERN.startswith("^[^") and NO_CONTROL_PATTERN.endswith("]*$")
    assert all(a <= b for a, b in FORBIDDEN) and all(b < a2 for (_, b), (a2, _) in itertools.pairwise(FORBIDDEN))


# ---------------------------------------------------------------- the schema's string fields


def leaves(node: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every string or quantity in the schema below node, as (path, its schema node); "[]" marks a
    list item, "{}" a map value and "{key}" a map key."""
    if node.get("type") == "string" or node.get("x-kubernetes-int-or-string"):
        yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from leaves(sub, (*path, name))
    if isinstance(node.get("items"), dict):
        yield from leaves(node["items"], (*path, "[]"))
    if isinstance(node.get("additionalProperties"), dict):
        yield (*path, "{key}"), {"type": "string", "x-kubernetes-validations": node.get("x-kubernetes-validations", [])}
        yield from leaves(node["additionalProperties"], (*path, "{}"))


SPEC_SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
FIELDS = list(leaves(SPEC_SCHEMA))
FIELD_IDS = [".".join(p) for p, _ in FIELDS]


def loose(pattern: str) -> bool:
    """Whether a pattern may admit a character it does not name: a negated class, a class
    escape (\\s, \\w, \\p{..}) or a dot outside a class."""
    outside = re.sub(r"\[(\^?)(?:\\.|[^\]])*\]", lambda m: "[^]" if m.group(1) else "", pattern)
    return "[^]" in outside or re.search(r"\\[sSwWdDpP]", pattern) is not None or re.search(r"(?<!\\)\.", outside) is not None


def test_the_fuzz_sees_the_fields_it_must() -> None:
    ids = set(FIELD_IDS)
    assert {"vllm.servedModelName", "image", "vllm.extraArgs.[]", "vllm.nodeSelector.{}",
            "vllm.nodeSelector.{key}", "vllm.tolerations.[].key", "vllm.tolerations.[].value", "l2.nvme.size",
            "lmcacheServer.resources.requests.{}", "lmcacheServer.resources.requests.{key}", "identity.modelId",
            "l2.hfBucket.bucketHandle"} <= ids
    assert len(FIELDS) >= 40


@pytest.mark.parametrize(("path", "node"), FIELDS, ids=FIELD_IDS)
def test_every_free_string_refuses_control_characters_at_apply_time(path: tuple[str, ...], node: dict[str, Any]) -> None:
    """Each string of the schema is an enum, has a strict ASCII pattern, or has the shared
    no-control pattern (a map's keys: in the CEL rule over them). A new free string field without
    kvpersist's FreeText type, or a strict one, fails here."""
    if "enum" in node:
        return
    if path[-1] == "{key}":  # the pattern the map's CEL rule matches each key against
        found = [m for rule in node["x-kubernetes-validations"] for m in re.findall(r"k\.matches\(r'([^']*)'\)", rule["rule"])]
        assert len(found) == 1, node
        pattern = found[0]
    else:
        pattern = node.get("pattern")
    assert pattern, f"spec.{'.'.join(path)} takes any string: give it a pattern or the FreeText type"
    if path[0] == "prewarm" and path[1] in ("prompts", "systemPrompts"):  # a prompt keeps its TAB, LF and CR
        assert pattern == PROMPT_PATTERN  # tests/unit/test_prewarm.py compares it with the models' check
        return
    assert pattern == NO_CONTROL_PATTERN or (pattern.isascii() and not loose(pattern)), pattern


# ---------------------------------------------------------------- the models' message


REFUSING = [
    ("vllm.servedModelName", "spec.vllm.servedModelName"),
    ("image", "spec.image"),
    ("vllm.extraArgs.[]", "spec.vllm.extraArgs.1"),
    ("vllm.nodeSelector.{}", "spec.vllm.nodeSelector.pool"),
    ("vllm.nodeSelector.{key}", "spec.vllm.nodeSelector"),
    ("vllm.tolerations.[].key", "spec.vllm.tolerations.0.key"),
    ("vllm.tolerations.[].value", "spec.vllm.tolerations.0.value"),
    ("lmcacheServer.resources.requests.{key}", "spec.lmcacheServer.resources.requests"),
]


@pytest.mark.parametrize("char", ["\u202e", "\x00", "\n", "\u200b", "\u2028", "\U000e0041"], ids=ascii)
@pytest.mark.parametrize(("field", "named"), REFUSING, ids=[f for f, _ in REFUSING])
def test_a_control_character_is_refused_naming_the_field_the_character_and_where(field: str, named: str, char: str) -> None:
    obj = holder(tuple(field.split(".")), "gpu" + char + "x")
    with pytest.raises(ValidationError) as info:
        KVCacheNamespace.model_validate(obj)
    message = validation_message(info.value)
    assert named in message, message
    assert f"U+{ord(char):04X}" in message and "at position 4 of 5" in message, message
    assert not any(forbidden(ch) for ch in message), ascii(message)  # it goes into a condition as is


def test_printable_escapes_only_refused_characters() -> None:
    assert printable("spec.vllm.nodeSelector.a\u202eb: x\ny é") == "spec.vllm.nodeSelector.a\\u202eb: x\\u000ay é"
    assert printable("\U000e0041") == "\\U000e0041"


def test_ordinary_free_strings_are_kept() -> None:
    obj = holder(("vllm", "servedModelName"), "Llama 3.1 8B — instruct, 日本語")
    obj["spec"]["vllm"]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    spec = KVCacheNamespace.model_validate(obj).spec
    assert spec.vllm.served_model_name == "Llama 3.1 8B — instruct, 日本語"


# ---------------------------------------------------------------- fuzz every field


# Objects a sample lacks, made with their required members, so a value under them can validate.
MADE = {("l2", "encryption", "keySecretRef"): {"name": "kv-master-key"}, ("vllm", "hfTokenSecretRef"): {"name": "hf-reader"},
        ("vllm", "apiKeySecretRef"): {"name": "vllm-api"},
        ("vllm", "inferencePool", "endpointPicker"): {"name": "kv-router-epp"}}


def _claim_instead_of_size(spec: dict[str, Any]) -> None:
    for key in ("size", "storageClassName", "budget"):
        spec["l2"]["nvme"].pop(key, None)


def _model_cache_made(spec: dict[str, Any]) -> None:
    spec["vllm"]["modelCache"] = {"size": "10Gi"}  # storageClassName and accessModes go with size


# Fields that exclude others of the sample: those are dropped first (or that need another set).
CONTEXT = {("l2", "nvme", "existingClaimName"): _claim_instead_of_size,
           ("vllm", "modelCache", "storageClassName"): _model_cache_made,
           ("vllm", "modelCache", "accessModes", "[]"): _model_cache_made}


TOLERATION = {"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"}
# A plausible item of each other list of objects, by the list's field name.
ITEMS: dict[str, dict[str, Any]] = {"env": {"name": "VLLM_LOGGING_LEVEL", "value": "INFO"},
                                    "envFrom": {"secretRef": {"name": "vllm-env"}}, "imagePullSecrets": {"name": "regcred"}}


def holder(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A sample with value at path (under spec), its parents made where the sample has none: a
    list item is the second element after a plausible first, a map value sits under a plausible
    key, a map key holds a plausible value."""
    obj = copy.deepcopy(sample("hf-bucket" if path[:2] == ("l2", "hfBucket") else "nvme-minimal"))
    if path[:2] == ("l2", "hfBucket"):
        obj["spec"]["l2"].pop("nvme", None)
    if path in CONTEXT:
        CONTEXT[path](obj["spec"])
    node: Any = obj["spec"]
    for i, key in enumerate(path):
        last = i == len(path) - 1
        nxt = None if last else path[i + 1]
        if key == "[]":
            if path[i - 1] == "extraArgs":  # the value of a flag that takes one
                node[:] = ["--root-path", value]
                return obj
            node[:] = [copy.deepcopy(ITEMS.get(path[i - 1], TOLERATION))]
            node = node[0]
        elif key == "{}":
            node.clear()
            node["memory" if "resources" in path else "pool"] = value
            return obj
        elif key == "{key}":
            node.clear()
            node[value if isinstance(value, str) else str(value)] = "1Gi" if "resources" in path else "gpu"
            return obj
        elif last:
            node[key] = value
        else:
            child = node.get(key)
            if not isinstance(child, (dict, list)):
                child = [] if nxt == "[]" else copy.deepcopy(MADE.get(path[:i + 1], {}))
                node[key] = child
            node = child
    return obj


def reconcile_path(obj: dict[str, Any]) -> None:
    """What the handlers do with an object the models accept, short of the API: the namespace
    id, the manifests, the image and Secret policy."""
    spec = KVCacheNamespace.model_validate(obj).spec
    resolved = resolve(spec.pins("0123456789abcdef"))
    build_all(Target(obj["metadata"]["name"], "ml", spec, resolved.namespace_id))
    image_refusal(spec, ("registry.example.com/",))
    named_secrets(spec)


def names(message: str, path: tuple[str, ...]) -> bool:
    """The error names the field (a list's item or a map's entry: the list or the map), or is a
    rule of the object holding it that names it too ("spec.l2.nvme: set exactly one of size ... or
    existingClaimName")."""
    cut = next((i for i, p in enumerate(path) if p in ("[]", "{}", "{key}")), len(path))
    field = "spec." + ".".join(path[:cut])
    if field in message:
        return True
    parent, leaf = "spec." + ".".join(path[:cut - 1]), path[cut - 1]
    return cut > 1 and parent in message and re.search(rf"\b{re.escape(leaf)}\b", message) is not None


HOSTILE_TEXT = ["", " ", "qwen\u202egnp.exe", "a\x00b", "x\ny", "\r\n", "\t", "\u200b", "\ufeffx", "\u2066x\u2069",
                "\x1b[31mred", "\u0085", "\U000e0041", "a" * 1025, "-", "--root-path", "../../etc", "1e309", "-1Gi",
                "é", "日本", "\u0301", "\U0001f600", "${HOME}", "$(id)", "'; drop", "a b"]
HOSTILE_ANY: list[Any] = [None, 0, -1, 2**63, 1.5, True, [], {}, ["x"], {"a": 1}]


def _from_pattern(node: dict[str, Any]) -> list[st.SearchStrategy]:
    pattern = node.get("pattern")
    if not pattern or pattern == NO_CONTROL_PATTERN:
        return []
    try:
        re.compile(pattern)
    except re.error:
        return []
    return [st.from_regex(pattern, fullmatch=True)]


def _with_a_refused_char(text: str, char: str, at: int) -> str:
    at = min(at, len(text))
    return text[:at] + char + text[at:]


REFUSED_CHARS = st.sampled_from([chr(a) for a, _ in FORBIDDEN] + [chr(b) for _, b in FORBIDDEN] + ["\u202e", "\u2028"])


def values(node: dict[str, Any]) -> st.SearchStrategy:
    plausible = st.one_of(*_from_pattern(node), st.sampled_from(node["enum"]) if "enum" in node else st.nothing(),
                          st.text(max_size=40))
    strategies = [
        plausible,
        st.builds(_with_a_refused_char, plausible, REFUSED_CHARS, st.integers(0, 40)),
        st.sampled_from(HOSTILE_TEXT),
        st.sampled_from(HOSTILE_ANY),
        st.text(alphabet=st.characters(codec="utf-8"), max_size=20),
    ]
    if node.get("x-kubernetes-int-or-string"):
        strategies += [st.from_regex(QUANTITY, fullmatch=True), st.integers(),
                       st.sampled_from(["500Gi", "1Ti", "8Gi", "2Gi", "1Mi", "8Ei", "1e18"])]
    return st.one_of(*strategies)


@pytest.mark.parametrize(("path", "node"), FIELDS, ids=FIELD_IDS)
def test_any_value_of_any_string_or_quantity_field_is_refused_naming_it_or_reconciles(path: tuple[str, ...],
                                                                                     node: dict[str, Any]) -> None:
    accepted = refused = 0

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(value=values(node))
    def one(value: Any) -> None:
        nonlocal accepted, refused
        obj = holder(path, value)
        try:
            KVCacheNamespace.model_validate(obj)
        except ValidationError as exc:
            refused += 1
            message = validation_message(exc)
            assert names(message, path), (ascii(value), message)
            assert not any(forbidden(ch) for ch in message), ascii(message)
            return
        accepted += 1
        reconcile_path(obj)  # anything raised here would be an exception out of a handler
        assert not isinstance(value, str) or control_problem(value) is None, ascii(value)

    one()
    assert refused > 0, "no value was refused: the strategy never left the valid set"
    if node.get("pattern") == NO_CONTROL_PATTERN:
        assert accepted > 0, "no value was accepted: the reconcile path was never reached"


def test_the_compiled_class_refuses_exactly_what_forbidden_names() -> None:
    """control_problem searches one compiled class (a resource's parse ran forbidden() per
    character, every status round): the same set, code point by code point."""
    from kvpersist.api import text

    chars = "".join(chr(c) for c in range(0x110000))
    found = {m.start() for m in text._REFUSED.finditer(chars)}
    assert found == {c for c in range(0x110000) if forbidden(chr(c))}
    assert text.control_problem("ok\u202eno") is not None and "position 3 of 5" in text.control_problem("ok\u202eno")
    assert text.control_problem("plain text") is None
