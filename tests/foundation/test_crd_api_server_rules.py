"""Guards, with no API server, for the rules a real one enforced on our CRDs.

A kube-apiserver refused both CRDs that KMock and local mode accepted: a description on
the root `metadata`, and messageExpressions whose estimated cost was unbounded
(`string(self.maxBlocks)` concatenated: a string of unknown length). Each test here fails
on that mistake. The limits and the cost model are the API server's
(`kvquota.api.cel_cost` names its sources).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvquota.api.cel_cost import (
    CRD_COST_LIMIT,
    RULE_COST_LIMIT,
    CelCostError,
    check_budget,
    crd_costs,
    expression_cost,
)
from kvquota.api.crd import KINDS, crd_path

CRDS = Path(__file__).resolve().parents[2] / "crds"


def _schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load(crd_path(CRDS, kind).read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


@pytest.mark.parametrize("kind", list(KINDS))
def test_root_metadata_declares_only_name_and_generate_name(kind: str) -> None:
    """The API server: 'must not specify anything other than name and generateName, but
    metadata is implicitly specified' (a description, too, is refused)."""
    metadata = _schema(kind)["properties"]["metadata"]
    assert set(metadata) <= {"type", "properties"}, metadata
    assert metadata.get("type", "object") == "object"
    assert set(metadata.get("properties", {})) <= {"name", "generateName"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_committed_crds_fit_the_api_servers_cel_budget(kind: str) -> None:
    costs = check_budget(kind, _schema(kind))
    assert costs, "every kind carries CEL rules"
    # Far below the limits, so a new bounded rule has room: the largest is a regex on
    # metadata.name (253 characters, a 40-character pattern).
    assert max(c.cost for c in costs) < RULE_COST_LIMIT / 1000
    assert sum(c.cost for c in costs) < CRD_COST_LIMIT / 1000


def _with_rule(kind: str, path: list[str], rule: dict[str, str]) -> dict[str, Any]:
    schema = copy.deepcopy(_schema(kind))
    node = schema
    for name in path:
        node = node["properties"][name]
    node.setdefault("x-kubernetes-validations", []).append(rule)
    return schema


def test_a_message_that_quotes_a_number_is_refused_where_the_api_server_refused_it() -> None:
    """The messageExpressions the API server refused (by more than 100x), put back."""
    schema = _with_rule("TenantQuota", ["spec", "kvCache"], {
        "rule": "self.maxBlocks >= self.guaranteedBlocks",
        "message": "maxBlocks must be >= guaranteedBlocks",
        "messageExpression": "'maxBlocks (' + string(self.maxBlocks) + ') must be >= "
                             "guaranteedBlocks (' + string(self.guaranteedBlocks) + ')'",
    })
    with pytest.raises(CelCostError, match=r"spec\.kvCache\[2\]\.messageExpression"):
        check_budget("TenantQuota", schema)
    # What the CRDs do instead: format() on a literal, which the same server accepted.
    schema["properties"]["spec"]["properties"]["kvCache"]["x-kubernetes-validations"][2][
        "messageExpression"] = ("'maxBlocks (%d) must be >= guaranteedBlocks (%d)'"
                                ".format([self.maxBlocks, self.guaranteedBlocks])")
    assert check_budget("TenantQuota", schema)


def test_a_rule_over_an_unbounded_string_in_an_unbounded_list_is_refused() -> None:
    schema = {"type": "object", "properties": {"items": {
        "type": "array",
        "items": {"type": "object", "properties": {"name": {"type": "string"}},
                  "x-kubernetes-validations": [{"rule": "self.name.startsWith('a')",
                                                "message": "m"}]},
    }}}
    with pytest.raises(CelCostError, match=r"items\[\*\]\[0\]\.rule"):
        check_budget("Example", schema)
    bounded = copy.deepcopy(schema)
    bounded["properties"]["items"]["maxItems"] = 16
    bounded["properties"]["items"]["items"]["properties"]["name"]["maxLength"] = 63
    (cost,) = crd_costs(bounded)
    assert cost.cost == 16 * cost.per_call  # once per item


def test_costs_grow_with_the_bounds_the_rule_reads() -> None:
    short = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                              "tags": {"type": "array", "maxItems": 4,
                                                       "items": {"type": "string",
                                                                 "maxLength": 10}}}}
    long = copy.deepcopy(short)
    long["properties"]["name"]["maxLength"] = 10_000
    long["properties"]["tags"]["maxItems"] = 4_000
    for rule in ("self.name.matches('^[a-z]+$')", "self.tags.all(t, t.startsWith('x'))"):
        assert expression_cost(rule, long) > 100 * expression_cost(rule, short)
    assert expression_cost("size(self.name) > 0", long) == expression_cost(
        "size(self.name) > 0", short)


def test_an_expression_it_cannot_bound_is_refused_not_guessed() -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}}
    with pytest.raises(CelCostError, match=r"no cost model for the method \.lowerAscii"):
        expression_cost("self.name.lowerAscii() == 'a'", schema)
    with pytest.raises(CelCostError, match="no field 'nmae'"):
        expression_cost("self.nmae == 'a'", schema)
