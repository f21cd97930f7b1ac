"""A CustomResourceDefinition's openAPIV3Schema made strict, as a JSON-schema validator.

The API server prunes (or, with strict field validation, rejects) keys a structural schema
does not list, so a misspelt `resouces:` in a RayService would deploy a pod without limits.
`strict_schema` closes every object the CRD describes (`additionalProperties: false` where
it lists `properties`), except where the CRD says `x-kubernetes-preserve-unknown-fields`.
The Kubernetes extensions JSON schema lacks are added as keywords: `nullable`,
`x-kubernetes-int-or-string`, `x-kubernetes-list-type` (set / map keys unique) and the
int32/int64 formats. CEL rules (`x-kubernetes-validations`) cannot be evaluated here:
`cel_rules_reached` lists the places a document would meet one, so a caller can refuse
to rely on them.
"""

from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml
from jsonschema import Draft7Validator, FormatChecker, ValidationError, validators

# Keys whose values are subschemas (everything else, e.g. `default`, `enum`, is data).
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf")
_SCHEMA_ONE = ("items", "not")


def load_crd(path: Path) -> dict[str, Any]:
    """The CustomResourceDefinition document at `path` (one document per file)."""
    crd = yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"{path}: not a CustomResourceDefinition")
    return crd


def strict_schema(node: Any) -> Any:
    """A deep copy of `node` in which every described object forbids unlisted keys."""
    if not isinstance(node, dict):
        return copy.deepcopy(node)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_ONE or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = strict_schema(value)
        elif key in _SCHEMA_LISTS:
            out[key] = [strict_schema(sub) for sub in value]
        else:
            out[key] = copy.deepcopy(value)
    if node.get("x-kubernetes-embedded-resource"):
        out.setdefault("properties", {})
        for name in ("apiVersion", "kind"):
            out["properties"].setdefault(name, {"type": "string"})
        out["properties"].setdefault("metadata", {"type": "object"})
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    is_object = node.get("type") == "object" or "properties" in node
    if is_object and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


# -- Kubernetes keywords JSON schema does not have --------------------------------------------
_base_type = Draft7Validator.VALIDATORS["type"]
_base_additional = Draft7Validator.VALIDATORS["additionalProperties"]


def _type(validator, types, instance, schema) -> Iterator[ValidationError]:
    if instance is None and schema.get("nullable"):
        return
    yield from _base_type(validator, types, instance, schema)


def _additional_properties(validator, additional, instance, schema) -> Iterator[ValidationError]:
    """`additionalProperties: false` as one readable error per unknown key, with a guess."""
    if additional is not False or not validator.is_type(instance, "object"):
        yield from _base_additional(validator, additional, instance, schema)
        return
    known = list(schema.get("properties", {}))
    for key in instance:
        if key not in known:
            guess = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            yield ValidationError(f"unknown key {key!r}{hint}")


def _list_type(validator, list_type, instance, schema) -> Iterator[ValidationError]:
    """`set`: items unique; `map`: items unique by `x-kubernetes-list-map-keys` (defaults applied)."""
    if not validator.is_type(instance, "array"):
        return
    if list_type == "set":
        seen: dict[str, int] = {}
        for i, item in enumerate(instance):
            key = json.dumps(item, sort_keys=True)
            if key in seen:
                yield ValidationError(f"duplicate item (items {seen[key]} and {i}) in a list-type set")
            seen.setdefault(key, i)
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        item_props = (schema.get("items") or {}).get("properties", {})
        seen_keys: dict[tuple, int] = {}
        for i, item in enumerate(instance):
            if not isinstance(item, dict):
                continue
            key = tuple(item.get(k, item_props.get(k, {}).get("default")) for k in keys)
            if key in seen_keys:
                yield ValidationError(
                    f"duplicate entry {dict(zip(keys, key))} (items {seen_keys[key]} and {i}); "
                    f"entries are keyed by {keys}")
            seen_keys.setdefault(key, i)


_FORMATS = FormatChecker(formats=())


@_FORMATS.checks("int32")
def _int32(value: Any) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _int64(value: Any) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


KubernetesValidator = validators.extend(Draft7Validator, {
    "type": _type,
    "additionalProperties": _additional_properties,
    "x-kubernetes-list-type": _list_type,
})


def _where(path) -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    return text.lstrip(".") or "<root>"


def _message(error: ValidationError) -> str:
    if error.validator == "pattern" and error.schema.get("x-kubernetes-int-or-string"):
        return f"{error.instance!r} is not a Kubernetes quantity (an integer or e.g. '1', '500m', '64Gi')"
    if error.validator == "maxLength":
        return f"{error.instance!r} has {len(error.instance)} characters, more than {error.validator_value}"
    return error.message


def schema_errors(schema: dict[str, Any], document: Any) -> list[str]:
    """Every violation of `schema` (already strict) in `document`, as 'path: message'."""
    validator = KubernetesValidator(schema, format_checker=_FORMATS)
    errors = sorted(validator.iter_errors(document), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{_where(e.absolute_path)}: {_message(e)}" for e in errors]


def cel_rules_reached(schema: dict[str, Any], document: Any, path: tuple = ()) -> list[str]:
    """Paths in `document` that carry a CEL rule (`x-kubernetes-validations`): unchecked here."""
    found = [_where(path)] if "x-kubernetes-validations" in schema else []
    if isinstance(document, dict):
        extra = schema.get("additionalProperties")
        for key, value in document.items():
            sub = schema.get("properties", {}).get(key) or (extra if isinstance(extra, dict) else None)
            if sub:
                found += cel_rules_reached(sub, value, path + (key,))
    elif isinstance(document, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(document):
            found += cel_rules_reached(schema["items"], item, path + (i,))
    return found


def object_meta_schema(max_name_length: int, name_pattern: str) -> dict[str, Any]:
    """The parts of ObjectMeta a manifest may set (a CRD leaves root `metadata` untyped)."""
    string_map = {"type": "object", "additionalProperties": {"type": "string"}}
    return {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": max_name_length, "pattern": name_pattern},
            "namespace": {"type": "string"},
            "labels": string_map,
            "annotations": string_map,
        },
        "additionalProperties": False,
    }


class StrictCrd:
    """One served version of a CRD, strict, checking whole documents of its kind."""

    def __init__(self, crd: dict[str, Any], version: Optional[str] = None,
                 metadata_schema: Optional[dict[str, Any]] = None) -> None:
        spec = crd["spec"]
        served = [v for v in spec["versions"] if v.get("served")]
        chosen = [v for v in served if v["name"] == version] if version else [v for v in served if v.get("storage")]
        if not chosen:
            raise ValueError(f"{crd['metadata']['name']}: no served version {version!r}")
        self.kind = spec["names"]["kind"]
        self.api_version = f"{spec['group']}/{chosen[0]['name']}"
        schema = copy.deepcopy(chosen[0]["schema"]["openAPIV3Schema"])
        schema["properties"]["apiVersion"] = {"type": "string", "enum": [self.api_version]}
        schema["properties"]["kind"] = {"type": "string", "enum": [self.kind]}
        schema["properties"].pop("status", None)  # written by the controller, never by a manifest
        if metadata_schema is not None:
            schema["properties"]["metadata"] = metadata_schema
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
        self.raw_schema = schema
        self.schema = strict_schema(schema)

    def errors(self, document: Any) -> list[str]:
        return schema_errors(self.schema, document)

    def subschema(self, *path: str) -> dict[str, Any]:
        """The strict schema at a property path, e.g. ('spec',) of a RayCluster."""
        node = self.schema
        for key in path:
            node = node["properties"][key]
        return node

    def cel_rules_reached(self, document: Any) -> list[str]:
        return cel_rules_reached(self.raw_schema, document)
