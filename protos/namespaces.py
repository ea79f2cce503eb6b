"""Namespaces: the tenant/app scope of blocks, pins and cleanups. A namespace is a key
segment in etcd (/kvcp/v1/pins/<namespace>/...) and part of each block's record on an
agent's disk, so one rule holds everywhere, checked where a name enters."""

from __future__ import annotations

import re

from protos import errors

DEFAULT_NAMESPACE = "default"
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def check_namespace(namespace: str, field: str = "scope.namespace") -> str:
    """The namespace ('' is the default one), or InvalidArgument naming `field`."""
    ns = namespace or DEFAULT_NAMESPACE
    if not _NAMESPACE_RE.fullmatch(ns):  # (match: a $ before a final newline passed "chat\n")
        raise errors.InvalidArgument(
            field, f"{namespace[:80]!r} is not a namespace (letters, digits, . _ -; at most 63)"
        )
    return ns
