"""A conservative worst-case cost of a CRD's CEL rules, as the API server estimates it.

The API server refuses a CRD whose rules might cost too much to evaluate, from the
schema's bounds alone, before any object exists: it estimates each rule's and each
messageExpression's worst case (a string's cost grows with its maxLength, a loop's with
its list's maxItems, and a rule under a list or map runs once per element), and an input
with no bound makes the estimate explode. KMock and cel-python have no such estimate, so
`kvquota crds` runs this one and refuses to write a CRD over budget.

It follows cel-go's cost model (checker/cost.go: a select or an identifier costs 1, a
string traversal 0.1 per character, a list literal 10, a regex match (string length +
1) x 0.1 x (pattern length x 0.25), a loop its range times its body, `format` its
template's traversal) and never estimates below it; what it
does not model (an unknown function) is refused rather than guessed. Where a value's
size cannot be bounded (a string built by `string(...)`), anything that traverses it is
unbounded, as on the server.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from celpy.celparser import CELParser
from lark import Token, Tree

# The API server's limits (k8s.io/apiextensions-apiserver
# pkg/apis/apiextensions/validation/validation.go, and k8s.io/apiserver
# pkg/apis/cel/config.go for the request size), the same from v1.25 to v1.36.
RULE_COST_LIMIT = 10_000_000  # StaticEstimatedCostLimit: one rule x its cardinality
CRD_COST_LIMIT = 100_000_000  # StaticEstimatedCRDCostLimit: every rule and message
MAX_REQUEST_SIZE_BYTES = 3 * 1024 * 1024  # an unbounded list holds at most this many items

# cel-go's cost factors (common/cost.go).
_TRAVERSAL = 0.1  # StringTraversalCostFactor
_REGEX = 0.25  # RegexStringLengthCostFactor
_LIST_CREATE = 10  # ListCreateBaseCost

UNBOUNDED = math.inf
# The API server gives metadata.name and generateName this bound in root rules.
_ROOT_METADATA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 253},
        "generateName": {"type": "string", "maxLength": 253},
    },
}
_STRING_OPS = {"startsWith": 1, "endsWith": 1, "contains": 2}
_MACROS = {"all", "exists", "exists_one", "map", "filter"}
_CONVERSIONS = {"string", "int", "uint", "double", "bool", "bytes", "duration", "timestamp"}


class CelCostError(ValueError):
    """A rule the estimator cannot bound, or one over the API server's budget."""


@dataclass(frozen=True)
class Value:
    """An expression's worst case: its cost, and its size (a string's characters, a
    list's items, a map's entries; 1 for scalars), with its schema when it is a field."""

    cost: float
    size: float = 1
    schema: dict[str, Any] | None = None


@dataclass(frozen=True)
class RuleCost:
    path: str  # where the API server reports it, e.g. spec.kvCache[0].rule
    cost: float  # as the API server compares it with RULE_COST_LIMIT
    per_call: float  # one evaluation, before the cardinality


def size_of(schema: dict[str, Any]) -> float:
    """The most characters, items or entries a value of `schema` can have."""
    kind = schema.get("type")
    if kind == "string":
        if "enum" in schema:
            return max(len(str(v)) for v in schema["enum"])
        return float(schema.get("maxLength", UNBOUNDED))
    if kind == "array":
        return float(schema.get("maxItems", MAX_REQUEST_SIZE_BYTES // 2))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return float(schema.get("maxProperties", MAX_REQUEST_SIZE_BYTES // 2))
    return 1


def _element(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    if schema is None:
        return None
    if schema.get("type") == "array":
        return dict(schema.get("items", {}))
    extra = schema.get("additionalProperties")
    return dict(extra) if isinstance(extra, dict) else None


def _field(value: Value, name: str) -> Value:
    props = (value.schema or {}).get("properties", {})
    sub = props.get(name) or _element(value.schema)
    if sub is None:
        raise CelCostError(f"no field {name!r} in the schema")
    return Value(value.cost + 1, size_of(sub), sub)


def _args(tree: Tree) -> list[Tree]:
    """A call's argument expressions."""
    for child in tree.children:
        if isinstance(child, Tree) and child.data == "exprlist":
            return [e for e in child.children if isinstance(e, Tree)]
    return []


class _Estimator:
    def __init__(self, scope: dict[str, Value]) -> None:
        self.scope = scope

    def estimate(self, tree: Tree) -> Value:
        method = getattr(self, f"_{tree.data}", None)
        if method is not None:
            result: Value = method(tree)
            return result
        child = tree.children[0] if len(tree.children) == 1 else None
        if isinstance(child, Tree):  # a precedence level with one operand passes through
            return self.estimate(child)
        raise CelCostError(f"no cost model for {tree.data!r}")

    def _ident(self, tree: Tree) -> Value:
        name = str(tree.children[0])
        if name not in self.scope:
            raise CelCostError(f"unknown identifier {name!r}")
        bound = self.scope[name]
        return Value(1, bound.size, bound.schema)

    def _member_dot(self, tree: Tree) -> Value:
        return _field(self.estimate(tree.children[0]), str(tree.children[1]))

    def _member_index(self, tree: Tree) -> Value:
        target, index = (self.estimate(c) for c in tree.children)
        element = _element(target.schema) or {}
        return Value(target.cost + index.cost + 1, size_of(element), element)

    def _paren_expr(self, tree: Tree) -> Value:
        return self.estimate(tree.children[0])

    def _binary(self, tree: Tree) -> tuple[Value, Value, str]:
        left_tree, right_tree = (c for c in tree.children if isinstance(c, Tree))
        op_tree = left_tree  # e.g. relation -> [relation_le -> [relation], addition]
        left = self.estimate(op_tree.children[0])
        return left, self.estimate(right_tree), str(op_tree.data)

    def _logical(self, tree: Tree) -> Value:
        parts = [self.estimate(c) for c in tree.children if isinstance(c, Tree)]
        return parts[0] if len(parts) == 1 else Value(sum(p.cost for p in parts))

    _conditionalor = _logical
    _conditionaland = _logical

    def _expr(self, tree: Tree) -> Value:
        parts = [self.estimate(c) for c in tree.children if isinstance(c, Tree)]
        if len(parts) == 1:
            return parts[0]
        condition, yes, no = parts
        return Value(condition.cost + max(yes.cost, no.cost), max(yes.size, no.size))

    def _relation(self, tree: Tree) -> Value:
        if len(tree.children) == 1:
            return self.estimate(tree.children[0])
        left, right, op = self._binary(tree)
        if op == "relation_in":
            return Value(left.cost + right.cost + right.size)
        if _is_text(left) or _is_text(right):
            return Value(left.cost + right.cost + _traverse(min(left.size, right.size)))
        return Value(left.cost + right.cost + 1)

    def _addition(self, tree: Tree) -> Value:
        if len(tree.children) == 1:
            return self.estimate(tree.children[0])
        left, right, _ = self._binary(tree)
        if _is_text(left) or _is_text(right):  # concatenation traverses both
            size = left.size + right.size
            return Value(left.cost + right.cost + _traverse(size), size, {"type": "string"})
        return Value(left.cost + right.cost + 1)

    def _multiplication(self, tree: Tree) -> Value:
        if len(tree.children) == 1:
            return self.estimate(tree.children[0])
        left, right, _ = self._binary(tree)
        return Value(left.cost + right.cost + 1)

    def _unary(self, tree: Tree) -> Value:
        operand = self.estimate(tree.children[-1])
        return operand if len(tree.children) == 1 else Value(operand.cost + 1)

    def _literal(self, tree: Tree) -> Value:
        token = tree.children[0]
        assert isinstance(token, Token)
        text = str(token)
        if token.type in ("STRING_LIT", "MLSTRING_LIT"):
            quotes = 6 if token.type == "MLSTRING_LIT" else 2
            return Value(0, len(text) - quotes - text[0].lower().count("r"), {"type": "string"})
        return Value(0)

    def _list_lit(self, tree: Tree) -> Value:
        items = [self.estimate(a) for a in _args(tree)]
        return Value(_LIST_CREATE + sum(i.cost for i in items), len(items))

    def _ident_arg(self, tree: Tree) -> Value:
        name = str(tree.children[0])
        args = [self.estimate(a) for a in _args(tree)]
        cost = sum(a.cost for a in args)
        if name in ("has", "size"):
            return Value(cost + 1)
        if name in _CONVERSIONS:  # the result's size is unknown (cel-go gives none)
            size = UNBOUNDED if name in ("string", "bytes") else 1
            return Value(cost + 1, size, {"type": "string"} if name == "string" else None)
        raise CelCostError(f"no cost model for the function {name}()")

    def _member_dot_arg(self, tree: Tree) -> Value:
        target_tree, name_token = tree.children[0], tree.children[1]
        name = str(name_token)
        target = self.estimate(target_tree)
        arg_trees = _args(tree)
        if name in _MACROS:
            variable = _variable(arg_trees[0])
            element = _element(target.schema) or {}
            inner = _Estimator({**self.scope, variable: Value(0, size_of(element), element)})
            body = sum(inner.estimate(a).cost for a in arg_trees[1:])
            return Value(target.cost + target.size * (body + 1), target.size, target.schema)
        args = [self.estimate(a) for a in arg_trees]
        cost = target.cost + sum(a.cost for a in args)
        if name in _STRING_OPS:
            return Value(cost + 1 + _traverse(target.size) * (args[0].size if name ==
                                                               "contains" else 1))
        if name == "matches":
            regex = math.ceil(args[0].size * _REGEX)
            return Value(cost + 1 + _traverse(target.size + 1) * regex)
        if name == "format":  # cel-go: the format string's traversal; the result unknown
            return Value(cost + _traverse(target.size), UNBOUNDED, {"type": "string"})
        if name == "size":
            return Value(cost + 1)
        raise CelCostError(f"no cost model for the method .{name}()")


def _variable(tree: Tree) -> str:
    for node in tree.iter_subtrees():
        if node.data == "ident":
            return str(node.children[0])
    raise CelCostError("a macro's first argument must be a variable")


def _is_text(value: Value) -> bool:
    return (value.schema or {}).get("type") == "string"


def _traverse(size: float) -> float:
    return UNBOUNDED if math.isinf(size) else math.ceil(size * _TRAVERSAL)


_PARSER = CELParser()


def expression_cost(expression: str, schema: dict[str, Any], *, root: bool = False) -> float:
    """One evaluation's worst-case cost of `expression` with `self` (and `oldSelf`) typed
    by `schema`."""
    if root:
        schema = {**schema, "properties": {**schema.get("properties", {}),
                                           "metadata": _ROOT_METADATA}}
    this = Value(0, size_of(schema), schema)
    try:
        tree = _PARSER.parse(expression)
    except Exception as err:  # celpy raises its own parse error types
        raise CelCostError(f"cannot parse {expression!r}: {err}") from err
    return _Estimator({"self": this, "oldSelf": this}).estimate(tree).cost


def _rule_sites(
    schema: dict[str, Any], path: str, cardinality: float,
) -> Iterator[tuple[dict[str, Any], str, float]]:
    yield schema, path, cardinality
    for name, sub in schema.get("properties", {}).items():
        yield from _rule_sites(sub, f"{path}.{name}" if path else name, cardinality)
    element = _element(schema)
    if element is not None:
        yield from _rule_sites(element, f"{path}[*]", cardinality * size_of(schema))


def crd_costs(schema: dict[str, Any]) -> list[RuleCost]:
    """Every rule's and messageExpression's cost in a CRD's openAPIV3Schema, as the API
    server adds them up: a rule times how often it can run, a message once."""
    costs: list[RuleCost] = []
    for node, path, cardinality in _rule_sites(schema, "", 1):
        for i, rule in enumerate(node.get("x-kubernetes-validations", [])):
            where = f"{path}[{i}]" if path else f"[{i}]"
            try:
                once = expression_cost(rule["rule"], node, root=not path)
                costs.append(RuleCost(f"{where}.rule", once * cardinality, once))
                if "messageExpression" in rule:
                    message = expression_cost(rule["messageExpression"], node, root=not path)
                    costs.append(RuleCost(f"{where}.messageExpression", message, message))
            except CelCostError as err:
                raise CelCostError(f"{where}: {err}") from err
    return costs


def check_budget(kind: str, schema: dict[str, Any]) -> list[RuleCost]:
    """`crd_costs`, or a CelCostError naming every expression over the API server's limit."""
    costs = crd_costs(schema)
    errors = [f"{kind} {c.path}: estimated cost {c.cost:g} exceeds {RULE_COST_LIMIT}"
              for c in costs if c.cost > RULE_COST_LIMIT]
    total = sum(c.cost for c in costs)
    if total > CRD_COST_LIMIT:
        errors.append(f"{kind}: estimated total cost {total:g} exceeds {CRD_COST_LIMIT}")
    if errors:
        raise CelCostError(
            "; ".join(errors) + " (the API server would refuse the CRD: bound the strings, "
            "lists and maps the rule reads with maxLength, maxItems and maxProperties, or "
            "say it in a static message)"
        )
    return costs
