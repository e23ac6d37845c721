"""Types every kind of the v1alpha1 API shares: object references, label selectors,
the object metadata the operator reads, and the model base that carries CEL rules.

As in Kueue's apis/, a kind's module holds its spec and status; what several kinds use
lives here, so the kinds never import each other.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue
from pydantic.alias_generators import to_camel

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


Name = Annotated[str, Field(min_length=1, max_length=253, pattern=NAME_PATTERN)]


ShortString = Annotated[str, Field(max_length=256)]


def with_cel_rules(*rules: tuple[str, str] | tuple[str, str, str]) -> ConfigDict:
    """Config for a model whose object carries CEL rules: (rule, message) or (rule,
    message, messageExpression). The API server shows the messageExpression's value (so
    it can quote the bad values), and the static message if that fails.

    A messageExpression quotes values with `'... %d ...'.format([self.x])`, never with
    `'...' + string(self.x)`: the API server's cost estimate takes a concatenation with a
    string of unknown length as unbounded and refuses the CRD (`kvquota.api.cel_cost`)."""
    validations: list[JsonValue] = []
    for rule, message, *expression in rules:
        validation: dict[str, JsonValue] = {"rule": rule, "message": message}
        if expression:
            validation["messageExpression"] = expression[0]
        validations.append(validation)
    return ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra={"x-kubernetes-validations": validations},
    )


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class LocalObjectRef(ApiModel):
    """A reference to an object in the same namespace."""

    name: Name = Field(description="The referenced object's name.")


class SecretKeyRef(ApiModel):
    """One key of a Secret in the same namespace."""

    name: Name = Field(description="The Secret's name.")
    key: str = Field(
        min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
        description="The key within the Secret.",
    )


class LabelSelectorRequirement(ApiModel):
    """One requirement on a pod label."""

    key: str = Field(min_length=1, max_length=317, description="The label's key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In/NotIn: the label's value is/is not one of values; "
        "Exists/DoesNotExist: the pod has/lacks the label, whatever its value."
    )
    values: list[Annotated[str, Field(max_length=63, description="A label value.")]] = Field(
        default_factory=list, max_length=64,
        description="The values In and NotIn compare with; empty for Exists and DoesNotExist.",
    )


class LabelSelector(BaseModel):
    """metav1.LabelSelector: a pod matches when it meets every matchLabels entry and
    every matchExpressions requirement."""

    model_config = with_cel_rules(
        (
            "size(self.matchLabels) + size(self.matchExpressions) > 0",
            "selector must have matchLabels or matchExpressions",
        )
    )
    match_labels: dict[
        str, Annotated[str, Field(max_length=63, description="The label's required value.")]
    ] = Field(
        default_factory=dict, json_schema_extra={"maxProperties": 32},
        description="Labels the pod must carry, each with exactly the given value.",
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=16,
        description="Requirements on the pod's labels; the pod must meet all of them.",
    )


class ObjectMeta(BaseModel):
    """The parts of metav1.ObjectMeta the operator reads; the rest passes through."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")
    name: str
    namespace: str = "default"
    generation: int | None = None
    uid: str | None = None
    creation_timestamp: datetime | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
