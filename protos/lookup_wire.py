"""The lookup socket's wire, shared by its server (controlplane.api.lookup_socket) and
client (cli.client.LookupSocket): addresses, and frames of a 4-byte little-endian length
followed by a kvcp.v1.LookupFrame / LookupFrameReply message."""

from __future__ import annotations

import socket

HEADER_BYTES = 4
# a LookupRequest at the control plane's limits (2^20 token ids as varints) fits in 8 MiB
MAX_FRAME_BYTES = 8 << 20
# a reply names every holder with a tier byte per block: as large as gRPC allows
MAX_REPLY_BYTES = 64 << 20


def split_address(address: str) -> tuple[int, str | tuple[str, int]]:
    """'unix:/path' or 'HOST:PORT' -> (address family, socket address)."""
    if address.startswith("unix:"):
        path = address[len("unix:") :]
        if not path:
            raise ValueError(f"lookup address {address!r}: give a path after unix:")
        return socket.AF_UNIX, path
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"lookup address {address!r}: expected HOST:PORT or unix:PATH")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return family, (host, int(port))


def frame(message: bytes) -> bytes:
    return len(message).to_bytes(HEADER_BYTES, "little") + message
