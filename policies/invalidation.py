"""Invalidation policy: what happens to the namespaces of a superseded producer. Pure."""

from __future__ import annotations

from enum import StrEnum
from typing import assert_never


class InvalidationPolicy(StrEnum):
    """`purge` deletes superseded namespaces in the background; `retain` keeps them for audit."""

    PURGE = "purge"
    RETAIN = "retain"


def to_purge(superseded: list[str], policy: InvalidationPolicy) -> list[str]:
    """The superseded namespaces to delete now. Either way they are never served again:
    keys carry the fingerprint digest, so a new producer cannot reach them."""
    match policy:
        case InvalidationPolicy.PURGE:
            return list(superseded)
        case InvalidationPolicy.RETAIN:
            return []
        case _:
            assert_never(policy)
