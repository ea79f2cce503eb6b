"""KV layout of a model, as an agent stores it.

One block is a tensor of shape [num_layers, 2, block_size, num_kv_heads, head_dim]
(keys and values of every layer for block_size tokens), in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protos.kv_format import DTYPE_BYTES, kv_block_bytes

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int8": torch.int8,
}
if hasattr(torch, "float8_e4m3fn"):
    TORCH_DTYPES["float8_e4m3fn"] = torch.float8_e4m3fn


MAX_MODEL_ID_BYTES = 256


@dataclass(frozen=True)
class ModelSpec:
    model_id: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        if len(self.model_id.encode()) > MAX_MODEL_ID_BYTES:
            # with a namespace (63) and the layout it must fit a disk block's header
            raise ValueError(f"model_id is {len(self.model_id.encode())} bytes; at most {MAX_MODEL_ID_BYTES}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not supported; use one of {', '.join(DTYPE_BYTES)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def layout(self) -> str:
        """The block layout as a short string (written beside blocks kept on disk)."""
        return f"{self.num_layers}x2x{self.block_size}x{self.num_kv_heads}x{self.head_dim}:{self.dtype}"

    def differences(self, other: ModelSpec) -> list[str]:
        """'field: other != self' for each layout field that differs (model_id aside)."""
        out = []
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "dtype"):
            if getattr(other, name) != getattr(self, name):
                out.append(f"{name} {getattr(other, name)} != {getattr(self, name)}")
        return out

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """'MODEL:block_size=16,num_layers=2,num_kv_heads=2,head_dim=64,dtype=float16'."""
        model_id, sep, rest = text.rpartition(":")  # the last ':': a model id may hold one (org:name)
        if not sep:
            raise ValueError(f"model spec {text!r} must look like NAME:block_size=16,num_layers=2,...")
        fields: dict[str, object] = {}
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = part.partition("=")
            if not eq or key not in {"block_size", "num_layers", "num_kv_heads", "head_dim", "dtype"}:
                raise ValueError(f"model spec {text!r}: bad field {part!r}")
            if key in fields:  # (the later one won quietly)
                raise ValueError(f"model spec {text!r}: {key} given twice")
            if key == "dtype":
                fields[key] = value
            else:
                try:
                    fields[key] = int(value)
                except ValueError:
                    raise ValueError(f"model spec {text!r}: {key} must be an integer, got {value!r}") from None
        missing = {"block_size", "num_layers", "num_kv_heads", "head_dim"} - set(fields)
        if missing:
            raise ValueError(f"model spec {text!r}: missing {', '.join(sorted(missing))}")
        return cls(model_id=model_id.strip(), **fields)  # type: ignore[arg-type]

    def format(self) -> str:
        return (
            f"{self.model_id}:block_size={self.block_size},num_layers={self.num_layers},"
            f"num_kv_heads={self.num_kv_heads},head_dim={self.head_dim},dtype={self.dtype}"
        )
