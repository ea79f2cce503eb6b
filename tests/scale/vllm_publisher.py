"""A publisher speaking vLLM's KV event wire format (vllm/distributed/kv_events.py):
msgspec structs like vLLM's (array-like tagged events, or maps as newer vLLM encodes
them), PUB multipart [topic, seq, payload] and a ROUTER replay socket. Written for the
tests; it lets a test drop a batch on PUB (kept for replay) or forget it entirely."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import zmq

from tests.helpers import free_port


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


# the map encoding of newer vLLM (no array_like)
class MapBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapBlockStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class VllmPublisher:
    def __init__(self, topic: str = "") -> None:
        self.ctx = zmq.Context.instance()
        self.port, self.replay_port = free_port(), free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def publish(self, batch, *, send: bool = True, keep: bool = True) -> int:
        """Encode and send one batch with the next seq; `send=False` loses it on PUB,
        `keep=False` keeps it out of the replay buffer. Returns its seq."""
        payload = batch if isinstance(batch, bytes) else msgspec.msgpack.encode(batch)
        return self.publish_raw([self.topic, None, payload], send=send, keep=keep)

    def publish_raw(self, frames: list, *, send: bool = True, keep: bool = True) -> int:
        with self._lock:
            seq = self.seq
            self.seq += 1
            if keep:
                self.buffer.append((seq, frames[2]))
        if send:
            self.pub.send_multipart([f if f is not None else seq.to_bytes(8, "big") for f in frames])
        return seq

    def drop_pub(self) -> None:
        """The engine goes away: its PUB socket closes (subscribers see the disconnect)."""
        self.pub.close(linger=0)

    def rebind_pub(self, timeout_seconds: float = 5.0) -> None:
        """The engine is back on the same endpoint."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            sock = self.ctx.socket(zmq.PUB)
            try:
                sock.bind(self.endpoint)
            except zmq.ZMQError:  # the old socket's port is released asynchronously
                sock.close(linger=0)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            self.pub = sock
            return

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            self.replay_requests += 1
            first = int.from_bytes(start, "big")
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= first]
            for s, p in items:
                self.router.send_multipart([client, b"", s.to_bytes(8, "big"), p])
            self.router.send_multipart([client, b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(linger=0)
        self.router.close(linger=0)
