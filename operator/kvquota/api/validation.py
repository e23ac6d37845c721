"""Validate objects exactly where `kubectl apply` would: the generated CRD schema.

Applies the schema's defaults, checks structure, bounds, patterns and enums, and
evaluates the CEL rules (`x-kubernetes-validations`) with cel-python. Messages follow
the API server's field-error format, so local mode and the tests say what the cluster
would say.
"""

from __future__ import annotations

import copy
import re
from functools import cache
from typing import Any

import celpy

from engine_sidecar.contract.names import API_VERSION, GROUP, VERSION
from kvquota.api.crd import KINDS, load_crd_schema

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}
_CEL = celpy.Environment()


_VERB = re.compile(r"%(.)")


def _format(template: Any, args: Any) -> Any:
    """CEL's strings extension `format`, for the verbs our messageExpressions use (`%d`,
    `%s`, `%%`); any other verb fails, and the rule's static message is shown."""
    values = iter(args)

    def verb(match: re.Match[str]) -> str:
        if match[1] == "%":
            return "%"
        if match[1] not in "ds":
            raise celpy.CELEvalError(f"format: unsupported verb %{match[1]}")
        return str(next(values))

    return celpy.celtypes.StringType(_VERB.sub(verb, str(template)))


@cache
def _program(rule: str) -> Any:
    return _CEL.program(_CEL.compile(rule), functions={"format": _format})


@cache
def _schema(kind: str) -> dict[str, Any]:
    return load_crd_schema(kind)


def _quote(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    return str(value).lower() if isinstance(value, bool) else str(value)


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill absent properties from `default`, recursively (the API server's defaulting)."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(value[name], sub)
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def _to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """Typed like the API server types it: `number` fields are doubles."""
    if schema.get("type") == "number" and isinstance(value, int):
        value = float(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", {})
        value = {k: _to_cel(v, props.get(k, extra)) for k, v in value.items()}
        return _cel_map(value)
    if isinstance(value, list):
        return celpy.celtypes.ListType([_to_cel(v, schema.get("items", {})) for v in value])
    return celpy.json_to_cel(value)


def _cel_map(value: dict[str, Any]) -> Any:
    return celpy.celtypes.MapType(
        {celpy.celtypes.StringType(k): v for k, v in value.items()}
    )


def _message(rule: dict[str, Any], activation: dict[str, Any]) -> str:
    """The rule's messageExpression evaluated, as the API server shows it; its static
    message when there is none, or when it fails or is not a non-empty string."""
    expression = rule.get("messageExpression")
    if expression:
        try:
            text = _program(expression).evaluate(activation)
        except celpy.CELEvalError:
            text = None
        if isinstance(text, str) and text.strip():
            return str(text)
    return str(rule["message"])


def _cel_value(value: Any) -> str:
    """How the API server shows the value a CEL rule refused: an object's or a list's
    is left out (field.OmitValueType), a scalar's quoted."""
    return "Invalid value" if isinstance(value, dict | list) else f"Invalid value: {_quote(value)}"


# Schema errors after which the API server runs no CEL rule (the custom resource
# strategy's hasBlockingErr: NotSupported, Required, TooLong, TooMany, TypeInvalid); it
# says so with this error. Other schema errors (pattern, bounds) leave the rules running.
_BLOCKING = (": Unsupported value: ", ": Required value", ": Too long: ", ": Too many: ",
             " in body must be of type ")
# Every object's name (apimachinery's IsDNS1123Subdomain), as the server words it.
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
    "'-' or '.', and must start and end with an alphanumeric character (e.g. "
    f"'example.com', regex used for validation is '{_SUBDOMAIN.pattern}')"
)
RULES_NOT_CHECKED = (
    "<nil>: Invalid value: null: some validation rules were not checked because the "
    "object was invalid; correct the existing errors to complete validation"
)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return next((name for name, types in _TYPES.items() if isinstance(value, types)), "null")


def _is_type(value: Any, expected: str) -> bool:
    if isinstance(value, bool) and expected in ("integer", "number"):
        return False
    return isinstance(value, _TYPES[expected])


class _Validator:
    """Two passes, as the API server: the schema, then the CEL rules unless a schema
    error blocks them (`_BLOCKING`)."""

    def __init__(self, rules: bool) -> None:
        self.rules = rules
        self.errors: list[str] = []

    def check(self, value: Any, schema: dict[str, Any], path: str, old: Any) -> None:
        if not self.rules:
            expected = schema.get("type")
            if expected and not _is_type(value, expected):
                found = _json_type(value)  # the server shows the type, not the value
                self.errors.append(
                    f'{path}: Invalid value: "{found}": {path} in body must be of type '
                    f'{expected}: "{found}"'
                )
                return
            self._check_scalar(value, schema, path)
        if isinstance(value, dict):
            self._check_object(value, schema, path, old if isinstance(old, dict) else None)
        elif isinstance(value, list):
            self._check_array(value, schema, path)
        if self.rules:
            self._check_rules(value, schema, path, old)

    def _check_scalar(self, value: Any, schema: dict[str, Any], path: str) -> None:
        if "enum" in schema and value not in schema["enum"]:
            supported = ", ".join(_quote(v) for v in schema["enum"])
            self.errors.append(
                f"{path}: Unsupported value: {_quote(value)}: supported values: {supported}"
            )
        if isinstance(value, str):
            if "maxLength" in schema and len(value) > schema["maxLength"]:
                self.errors.append(
                    f"{path}: Too long: may not be more than {schema['maxLength']} bytes"
                )
            if "minLength" in schema and len(value) < schema["minLength"]:
                self.errors.append(
                    f"{path}: Invalid value: {_quote(value)}: {path} in body should be at "
                    f"least {schema['minLength']} chars long"
                )
            if "pattern" in schema and not re.search(schema["pattern"], value):
                self.errors.append(
                    f"{path}: Invalid value: {_quote(value)}: {path} in body should match "
                    f"'{schema['pattern']}'"
                )
        if isinstance(value, int | float) and not isinstance(value, bool):
            if "minimum" in schema and value < schema["minimum"]:
                self.errors.append(
                    f"{path}: Invalid value: {value}: {path} in body should be greater than "
                    f"or equal to {schema['minimum']}"
                )
            if "multipleOf" in schema and value % schema["multipleOf"]:
                self.errors.append(
                    f"{path}: Invalid value: {value}: {path} in body should be a multiple of "
                    f"{schema['multipleOf']}"
                )
            if "maximum" in schema and value > schema["maximum"]:
                self.errors.append(
                    f"{path}: Invalid value: {value}: {path} in body should be less than "
                    f"or equal to {schema['maximum']}"
                )

    def _check_object(
        self, value: dict[str, Any], schema: dict[str, Any], path: str, old: dict[str, Any] | None
    ) -> None:
        props: dict[str, Any] = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for name in schema.get("required", []) if not self.rules else ():
            if name not in value:
                self.errors.append(f"{path}.{name}: Required value")
        if not self.rules and "maxProperties" in schema and len(value) > schema["maxProperties"]:
            self.errors.append(
                f"{path}: Too many: {len(value)}: must have at most "
                f"{schema['maxProperties']} items"
            )
        for name, sub_value in value.items():
            sub_path = f"{path}.{name}"
            sub_old = old.get(name) if old else None
            if name in props:
                self.check(sub_value, props[name], sub_path, sub_old)
            elif isinstance(extra, dict):
                self.check(sub_value, extra, sub_path, sub_old)
            elif not (self.rules or schema.get("x-kubernetes-preserve-unknown-fields")) and props:
                self.errors.append(f'unknown field "{sub_path}"')

    def _check_array(self, value: list[Any], schema: dict[str, Any], path: str) -> None:
        if self.rules:
            for index, item in enumerate(value):
                self.check(item, schema.get("items", {}), f"{path}[{index}]", None)
            return
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            self.errors.append(
                f"{path}: Too many: {len(value)}: must have at most {schema['maxItems']} items"
            )
        if "minItems" in schema and len(value) < schema["minItems"]:
            self.errors.append(
                f"{path}: Invalid value: {len(value)}: {path} in body should have at least "
                f"{schema['minItems']} items"
            )
        keys = schema.get("x-kubernetes-list-map-keys")
        seen: set[tuple[Any, ...]] = set()
        for index, item in enumerate(value):
            item_path = f"{path}[{index}]"
            self.check(item, schema.get("items", {}), item_path, None)
            if keys and isinstance(item, dict):
                key = tuple(item.get(k) for k in keys)
                if key in seen:
                    self.errors.append(f"{item_path}: Duplicate value: {_quote(key[0])}")
                seen.add(key)

    def _check_rules(self, value: Any, schema: dict[str, Any], path: str, old: Any) -> None:
        for rule in schema.get("x-kubernetes-validations", []):
            uses_old = "oldSelf" in rule["rule"]
            if uses_old and old is None:
                continue  # transition rules run on update only
            activation = {"self": _to_cel(value, schema)}
            if uses_old:
                activation["oldSelf"] = _to_cel(old, schema)
            try:
                ok = _program(rule["rule"]).evaluate(activation)
            except celpy.CELEvalError as exc:
                ok = exc
            if ok is not True and not (
                isinstance(ok, celpy.celtypes.BoolType) and bool(ok)
            ):
                message = _message(rule, activation)
                self.errors.append(f"{path}: {_cel_value(value)}: {message}")


def _normalised(kind: Any) -> str:
    return str(kind).lower().removesuffix("s")


def kind_error(api_version: Any, kind: Any) -> str | None:
    """What `kubectl apply` says for a kind or version our CRDs do not serve (None: one
    they serve), with the kind or group that was probably meant."""
    if api_version == API_VERSION and kind in KINDS:
        return None
    hints = []
    meant = next((k for k in KINDS if _normalised(k) == _normalised(kind)), None)
    if meant and meant != kind:
        hints.append(f"kind {meant}")
    group = str(api_version).rpartition("/")[0]
    if group != GROUP:
        hints.append(f"group {GROUP}")
    elif api_version != API_VERSION:
        hints.append(f"version {VERSION}, the only one served")
    hint = f" (did you mean {' and '.join(hints)}?)" if hints else ""
    return (f"no matches for kind {_quote(kind)} in version {_quote(api_version)}: "
            f"expected apiVersion {API_VERSION} and kind one of {', '.join(KINDS)}{hint}")


def is_ours(api_version: Any, kind: Any) -> bool:
    """Meant for our CRDs (served or not): our group or one naming kvquota, or one of
    our kind names in any group except another API's InferencePool (the Gateway API
    inference extension has one)."""
    group = str(api_version).rpartition("/")[0]
    if group == GROUP or "kvquota" in group:
        return True
    return _normalised(kind) == _normalised("TenantQuota")


def validate_object(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Errors the API server would give for `obj` (an update of `old` when given).

    `obj` is defaulted in place first, as the API server does before validating.
    """
    kind = obj.get("kind")
    refusal = kind_error(obj.get("apiVersion"), kind)
    if refusal:
        return [refusal]
    metadata = obj.get("metadata") or {}
    if not metadata.get("name"):
        return ["metadata.name: Required value: name or generateName is required"]
    schema = _schema(kind)
    apply_defaults(obj, schema)
    errors = [f"{name}: Required value" for name in schema.get("required", []) if name not in obj]
    object_name = str(metadata["name"])
    if len(object_name) > 253 or not _SUBDOMAIN.fullmatch(object_name):
        errors.append(
            f"metadata.name: Invalid value: {_quote(object_name)}: {_SUBDOMAIN_MESSAGE}")
    for rules in (False, True):
        validator = _Validator(rules)
        for name in ("spec", "status"):
            if name in obj:
                sub_old = old.get(name) if old else None
                validator.check(obj[name], schema["properties"][name], name, sub_old)
        if rules:
            validator._check_rules(obj, schema, "<nil>", old)
        errors += validator.errors
        unknown = [error for error in errors if error.startswith("unknown field ")]
        if unknown:  # the server's strict decoding refuses the object before validating
            return unknown
        if any(marker in error for error in errors for marker in _BLOCKING):
            return [*errors, RULES_NOT_CHECKED]
    return errors


def describe(obj: dict[str, Any], errors: list[str]) -> str:
    """One line like kubectl prints for a refused object."""
    meta = obj.get("metadata") or {}
    plural = KINDS.get(str(obj.get("kind")), {}).get("plural", obj.get("kind"))
    return f'{plural}.kvquota.dev "{meta.get("name", "?")}" is invalid: ' + "; ".join(errors)
