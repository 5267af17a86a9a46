"""The canonical fields two requests differ in, as paths (`max_tokens`,
`messages[3].content`, `tools[0].parameters`): what `explain` tells a user whose request
missed. Pure: two wire forms (CanonicalRequest.wire()) in, paths out."""

from __future__ import annotations

from typing import Any


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Every path at which `a` and `b` differ, in field order; a list of another length
    differs at its own path (`messages: 3 items vs 5`) and item by item up to the shorter."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for name in [*a, *(k for k in b if k not in a)]:
            where = f"{path}.{name}" if path else str(name)
            if name not in a or name not in b:
                out.append(where)
            else:
                out += differences(a[name], b[name], where)
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        out = [f"{path or '$'}: {len(a)} items vs {len(b)}"] if len(a) != len(b) else []
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    return [] if a == b and type(a) is type(b) else [path or "$"]
