"""How every part words a model that does not validate: a policy file, a ConfigMap, a
quota's spec, a bench scenario.

One line per problem, `path: message`, without pydantic's documentation URLs or the
input values (a policy holds tenants' settings, and a bad value may be a secret pasted
in the wrong field).
"""

from __future__ import annotations

from pydantic import ValidationError


def problems(error: ValidationError, *, prefix: str = "", top: str = "(document)") -> list[str]:
    """`path: message` for each problem; paths start with `prefix` when one is given,
    and a problem with the whole object is named `top`."""
    lines = []
    for item in error.errors(include_url=False, include_input=False):
        path = ".".join([*([prefix] if prefix else []), *(str(p) for p in item["loc"])])
        message = str(item["msg"]).removeprefix("Value error, ")
        lines.append(f"{path or top}: {message}")
    return lines
