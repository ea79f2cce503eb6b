"""KV block codecs, applied per block and transparent on load.

A block is a tensor [num_layers, 2, block_size, num_kv_heads, head_dim] (index 0 of
axis 1 holds keys, 1 values). Every codec maps it to a flat uint8 payload and back;
the payload layout is fixed by the shape, so no per-block header is needed beyond the
codec name kept in the block's metadata.

- `none`: the raw bytes.
- `int8`: symmetric, one fp16 scale per (layer, k/v, token, head) over head_dim.
- `int4`: KIVI-style asymmetric 4-bit: keys quantized per channel (groups along the
  token axis), values per token (groups along head_dim); one fp16 scale and minimum
  per group; two values packed per byte.
- `fp8`: float8_e4m3fn with one fp16 scale per (layer, k/v, token, head), where torch
  has the dtype.
- `zstd`: lossless zstandard of the raw bytes (for the disk tier).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protos import native

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
INT4_GROUP = 128


class CodecError(ValueError):
    pass


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _rows_u8(t: torch.Tensor) -> torch.Tensor:
    """A batch [n, ...] as bytes, one row of its elements' bytes per block: [n, bytes]."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c as a true division on every device: CUDA turns a division by a Python scalar
    into a multiplication by its reciprocal, which rounds differently from the host's
    division (and the C loops'), and the payloads must be the same bytes everywhere."""
    return x / torch.full((), c, dtype=x.dtype, device=x.device)


def _take(buf: torch.Tensor, offset: int, n: int, dtype: torch.dtype, shape) -> tuple[torch.Tensor, int]:
    itemsize = torch.tensor([], dtype=dtype).element_size()
    size = n * itemsize
    if offset + size > buf.numel():
        raise CodecError("payload is truncated")
    part = buf[offset : offset + size]
    if part.storage_offset() % itemsize:  # after an odd-length section: a view would fail
        part = part.clone()
    return part.view(dtype).reshape(shape), offset + size


# ---- int8 ---------------------------------------------------------------------------
_NATIVE_SOURCE = Path(__file__).with_name("codec_kernel.c")
_NATIVE_SETUP = threading.Lock()


def _native():
    """The C int8, int4 and fp8 loops (codec_kernel.c), or None: torch then does the same
    arithmetic."""
    lib: Any = native.load(_NATIVE_SOURCE, "KVCP_CODEC_KERNEL")  # its signatures are set here
    if lib is None or hasattr(lib, "_kvcp_ready"):
        return lib
    with _NATIVE_SETUP:  # codec threads' first calls at once: none calls a loop before its signature is set
        if hasattr(lib, "_kvcp_ready"):
            return lib
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.int8_encode.argtypes = [p, i, i, p, p]
        lib.int8_decode.argtypes = [p, p, i, i, p]
        lib.int4_encode.argtypes = [p, i, i, i, i, i, i, i, i, p, p, p, p, p, p]
        lib.int4_decode.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i, i, i, p]
        lib.fp8_encode.argtypes = [p, i, i, p, p]
        lib.fp8_decode.argtypes = [p, p, i, i, p]
        for f in (lib.int8_encode, lib.int8_decode, lib.fp8_encode, lib.fp8_decode):
            f.restype = None
        lib.int4_encode.restype = lib.int4_decode.restype = ctypes.c_int  # -1: head_dim too wide
        lib._kvcp_ready = True
    return lib


def _native_ok(x: torch.Tensor) -> bool:
    return x.dtype == torch.float16 and x.device.type == "cpu" and x.dim() >= 1 and x.shape[-1] > 0


def _rows_encode_native(name: str, x: torch.Tensor) -> torch.Tensor | None:
    """int8 / fp8 of an fp16 block in C (`name`: its encode function): an fp16 scale per
    row of head_dim values, then a byte per value. None: not available here."""
    lib = _native() if _native_ok(x) else None
    if lib is None:
        return None
    x = x.contiguous()
    d = x.shape[-1]
    rows = x.numel() // d
    out = torch.empty(2 * rows + x.numel(), dtype=torch.uint8)
    getattr(lib, name)(x.data_ptr(), rows, d, out.data_ptr(), out.data_ptr() + 2 * rows)
    qmax = 127.0 if name.startswith("int8") else FP8_MAX
    _decodable(_largest_np(out.numpy()[: 2 * rows].view(np.float16), qmax), True)
    return out


def _rows_decode_native(name: str, scale: torch.Tensor, q: torch.Tensor, shape, dtype) -> torch.Tensor | None:
    """The inverse of _rows_encode_native, to fp16; None: not available here."""
    lib = _native() if dtype == torch.float16 and shape and shape[-1] > 0 else None
    if lib is None:
        return None
    scale, q = scale.contiguous(), q.contiguous()
    out = torch.empty(shape, dtype=torch.float16)
    getattr(lib, name)(q.data_ptr(), scale.data_ptr(), scale.numel(), shape[-1], out.data_ptr())
    return out


_NOT_ENCODED = "the block holds values its fp16 scales cannot (inf, NaN, or beyond fp16's range): not encoded"
FP16_MAX = 65504.0


def _decodable(largest: float, fp16_block: bool) -> None:
    """`largest`: the largest magnitude the payload decodes to (qmax x scale, plus the
    minimum's for int4), as stored in fp16. Infinite or NaN (the block held inf or NaN,
    or a bf16 / fp32 block went past what an fp16 scale holds), or past fp16's range for
    an fp16 block (it would decode to inf): CodecError, the block is not encoded."""
    if not math.isfinite(largest) or (fp16_block and largest > FP16_MAX):
        raise CodecError(_NOT_ENCODED)


def _largest(scale16: torch.Tensor, qmax: float, lo16: torch.Tensor | None = None) -> float:
    """int8 / fp8 decode to at most qmax x scale; int4 to [min, min + 15 x scale]."""
    top = scale16.float().abs() * qmax
    if lo16 is not None:
        lo = lo16.float()
        top = torch.maximum(lo.abs(), (lo + top).abs())
    return float(top.amax()) if top.numel() else 0.0


def _largest_np(scales: np.ndarray, qmax: float, lows: np.ndarray | None = None) -> float:
    """_largest of scales (and minimums) read straight from a C loop's payload."""
    top = np.abs(scales.astype(np.float32)) * qmax
    if lows is not None:
        lo = lows.astype(np.float32)
        top = np.maximum(np.abs(lo), np.abs(lo + top))
    return float(top.max()) if top.size else 0.0


def _half_up(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales (> 0, or NaN) as the fp16 they are stored as: the nearest, or, where
    that is an fp16 subnormal below the scale, the next one up (its rounding error is a
    large part of it there, and values quantized with it would clamp). Values are
    quantized with the stored scale, the one decode multiplies by: quantizing with the
    fp32 one cost a row of amax 1e-4 3.7 % in int8. The C loops' half_up."""
    s16 = scale.to(torch.float16)
    back = s16.float()
    below = (back < scale) & (back < 2.0**-14)
    if bool(below.any()):
        s16 = torch.where(below, (s16.view(torch.int16) + 1).view(torch.float16), s16)
    return s16


def _int8_batch(x: torch.Tensor) -> torch.Tensor:
    """int8 of blocks [n, ...] on their device -> payloads [n, bytes]: the C loops' bytes."""
    xf = x.float()
    scale16 = _half_up(_div(xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8), 127.0))
    q = torch.round(xf / scale16.float()).clamp_(-127, 127).to(torch.int8)
    _decodable(_largest(scale16, 127.0), x.dtype == torch.float16)
    return torch.cat([_rows_u8(scale16), _rows_u8(q)], dim=1)


def _int8_encode(x: torch.Tensor) -> torch.Tensor:
    out = _rows_encode_native("int8_encode", x)
    return out if out is not None else _int8_batch(x[None])[0]


def _int8_decode(buf: torch.Tensor, shape, dtype) -> torch.Tensor:
    n_scale = math.prod(shape[:-1])
    scale, off = _take(buf, 0, n_scale, torch.float16, (*shape[:-1], 1))
    q, _ = _take(buf, off, math.prod(shape), torch.int8, shape)
    out = _rows_decode_native("int8_decode", scale, q, shape, dtype)
    if out is not None:
        return out
    return _rows_decode_batch(buf[None], shape, dtype, torch.int8)[0]


# ---- fp8 ----------------------------------------------------------------------------
def _fp8_batch(x: torch.Tensor) -> torch.Tensor:
    if FP8 is None:
        raise CodecError("this torch build has no float8_e4m3fn")
    xf = x.float()
    scale16 = _half_up(_div(xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8), FP8_MAX))
    q = (xf / scale16.float()).to(FP8)
    _decodable(_largest(scale16, FP8_MAX), x.dtype == torch.float16)
    return torch.cat([_rows_u8(scale16), _rows_u8(q)], dim=1)


def _fp8_encode(x: torch.Tensor) -> torch.Tensor:
    if FP8 is None:
        raise CodecError("this torch build has no float8_e4m3fn")
    out = _rows_encode_native("fp8_encode", x)
    return out if out is not None else _fp8_batch(x[None])[0]


def _fp8_decode(buf: torch.Tensor, shape, dtype) -> torch.Tensor:
    if FP8 is None:
        raise CodecError("this torch build has no float8_e4m3fn")
    n_scale = math.prod(shape[:-1])
    scale, off = _take(buf, 0, n_scale, torch.float16, (*shape[:-1], 1))
    q, _ = _take(buf, off, math.prod(shape), FP8, shape)
    out = _rows_decode_native("fp8_decode", scale, q, shape, dtype)
    if out is not None:
        return out
    return _rows_decode_batch(buf[None], shape, dtype, FP8)[0]


# ---- int4 (KIVI) --------------------------------------------------------------------
def _groups(n: int) -> int:
    return max(1, math.ceil(n / INT4_GROUP))


def _quant4(x: torch.Tensor, fp16_block: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [n, ..., G, g], a batch grouped on the last axis (in fp32) -> (nibbles packed two
    a byte [n, bytes], scale fp16, min fp16). `fp16_block`: the blocks were fp16, whose
    decode must not pass 65504 (x itself is their fp32 copy)."""
    n = x.shape[0]
    lo = x.amin(dim=-1, keepdim=True) + 0.0  # -0 -> +0: which zero amin returns depends on its order
    hi = x.amax(dim=-1, keepdim=True)
    scale = _div(hi - lo, 15.0).clamp_min(1e-8)
    q = torch.round((x - lo) / scale).clamp_(0, 15).to(torch.uint8).reshape(n, -1)
    if q.shape[1] % 2:
        q = torch.cat([q, q.new_zeros(n, 1)], dim=1)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    scale16, lo16 = scale.to(torch.float16), lo.to(torch.float16)
    _decodable(_largest(scale16, 15.0, lo16), fp16_block)
    return packed, scale16, lo16


def _pad_groups(x: torch.Tensor, axis_len: int) -> tuple[torch.Tensor, int]:
    """Pad the last axis to a multiple of the group count -> [..., G, g]."""
    g_count = _groups(axis_len)
    g = math.ceil(axis_len / g_count)
    pad = g_count * g - axis_len
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], g_count, g), g_count * g


def _int4_layout(shape) -> tuple[int, int, int, int, list[int]]:
    """(gk, Gk, gv, Gv, section sizes in bytes): keys' group length and count along the
    tokens, values' along head_dim, and the payload's six sections (key scales, key
    minimums, key nibbles, then the same for values)."""
    L, _, T, H, D = shape
    Gk, Gv = _groups(T), _groups(D)
    gk, gv = math.ceil(T / Gk), math.ceil(D / Gv)
    nk, nv = L * H * D * Gk, L * T * H * Gv
    return gk, Gk, gv, Gv, [2 * nk, 2 * nk, (nk * gk + 1) // 2, 2 * nv, 2 * nv, (nv * gv + 1) // 2]


def _section_ptrs(base: int, sizes: list[int]) -> list[int]:
    """Start addresses of consecutive payload sections of `sizes` bytes from `base`."""
    out = []
    for n in sizes:
        out.append(base)
        base += n
    return out


def _int4_native(shape, dtype) -> ctypes.CDLL | None:
    ok = dtype == torch.float16 and len(shape) == 5 and shape[1] == 2 and all(n > 0 for n in shape)
    return _native() if ok else None


def _int4_encode(x: torch.Tensor) -> torch.Tensor:
    lib = _int4_native(tuple(x.shape), x.dtype) if x.device.type == "cpu" else None
    if lib is not None:
        x = x.contiguous()
        L, _, T, H, D = x.shape
        gk, Gk, gv, Gv, sizes = _int4_layout(x.shape)
        out = torch.empty(sum(sizes), dtype=torch.uint8)
        if lib.int4_encode(x.data_ptr(), L, T, H, D, gk, Gk, gv, Gv, *_section_ptrs(out.data_ptr(), sizes)) == 0:
            raw = out.numpy()
            nk, nv = sizes[0] // 2, sizes[3] // 2
            v_at = sum(sizes[:3])  # (it may be an odd byte: frombuffer reads it unaligned)
            k_scale, k_lo = raw[: 2 * nk].view(np.float16), raw[2 * nk : 4 * nk].view(np.float16)
            v_scale = np.frombuffer(raw, np.float16, nv, v_at)
            v_lo = np.frombuffer(raw, np.float16, nv, v_at + 2 * nv)
            _decodable(_largest_np(k_scale, 15.0, k_lo), True)  # each: max() would drop a NaN
            _decodable(_largest_np(v_scale, 15.0, v_lo), True)
            return out
    return _int4_batch(x[None])[0]


def _int4_batch(x: torch.Tensor) -> torch.Tensor:
    """int4 of blocks [n, L, 2, T, H, D] on their device -> payloads [n, bytes]."""
    xf = x.float()
    k_t = xf[:, :, 0].permute(0, 1, 3, 4, 2)  # keys [n, L, H, D, T]: per channel -> groups along tokens
    vals = xf[:, :, 1]  # [n, L, T, H, D]: per token -> groups along D
    kg, _ = _pad_groups(k_t, k_t.shape[-1])
    vg, _ = _pad_groups(vals, vals.shape[-1])
    parts = []
    for grouped in (kg, vg):
        packed, scale, lo = _quant4(grouped, x.dtype == torch.float16)
        parts += [_rows_u8(scale), _rows_u8(lo), packed]
    return torch.cat(parts, dim=1)


def _int4_decode(buf: torch.Tensor, shape, dtype) -> torch.Tensor:
    if len(shape) != 5:
        raise CodecError(f"int4 needs blocks [layers, 2, tokens, heads, dim], not {list(shape)}")
    gk, Gk, gv, Gv, sizes = _int4_layout(shape)
    if buf.numel() < sum(sizes):
        raise CodecError("payload is truncated")
    lib = _int4_native(shape, dtype)
    if lib is not None:
        buf = buf.contiguous()
        out = torch.empty(shape, dtype=torch.float16)
        ptrs = _section_ptrs(buf.data_ptr(), sizes)
        if lib.int4_decode(*ptrs, *shape[:1], *shape[2:], gk, Gk, gv, Gv, out.data_ptr()) == 0:
            return out
    return _int4_decode_batch(buf[: sum(sizes)][None], shape, dtype)[0]


# ---- zstd ---------------------------------------------------------------------------
def _zstd_encode(x: torch.Tensor) -> torch.Tensor:
    import zstandard

    raw = _u8(x).numpy().tobytes()
    return torch.frombuffer(bytearray(zstandard.ZstdCompressor(level=1).compress(raw)), dtype=torch.uint8)


def _zstd_decode(buf: torch.Tensor, shape, dtype) -> torch.Tensor:
    import zstandard

    try:
        raw = zstandard.ZstdDecompressor().decompress(buf.numpy().tobytes())
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd payload is corrupt: {exc}") from None
    if len(raw) != payload_bytes("none", shape, dtype):
        raise CodecError("zstd payload has the wrong size")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


CODECS = {
    "int8": (_int8_encode, _int8_decode),
    "int4": (_int4_encode, _int4_decode),
    "fp8": (_fp8_encode, _fp8_decode),
    "zstd": (_zstd_encode, _zstd_decode),
}
LOSSY = {"int8", "int4", "fp8"}


def available_codecs() -> list[str]:
    return ["none"] + [c for c in CODECS if c != "fp8" or FP8 is not None]


def check_codec(name: str) -> str:
    if name not in available_codecs():
        raise CodecError(f"unknown codec {name!r}; expected one of {'|'.join(available_codecs())}")
    return name


def encode(codec: str, block: torch.Tensor) -> torch.Tensor:
    """A block tensor -> flat uint8 payload (on the CPU). A lossy codec runs where the
    block is: a GPU block is quantized on the GPU (the same arithmetic as on the CPU, bit
    for bit) and only its smaller payload crosses to the host."""
    check_codec(codec)
    block = block.detach()
    if codec in LOSSY and not block.dtype.is_floating_point:
        raise CodecError(f"codec {codec} needs a floating-point KV dtype, not {block.dtype}")
    if codec in LOSSY and block.device.type != "cpu":
        return CODECS[codec][0](block).to("cpu")
    block = block.to("cpu")
    if codec == "none":
        return _u8(block)
    return CODECS[codec][0](block)


BATCHED = {"int8": _int8_batch, "int4": _int4_batch, "fp8": _fp8_batch}


def encode_batch(codec: str, blocks: torch.Tensor, on_host: bool = True) -> list[torch.Tensor]:
    """Blocks [n, ...] of one shape -> their payloads, each the bytes encode() writes for
    it. A lossy codec runs once over the whole batch where the blocks are (on the GPU: a
    few kernels for n blocks, then one copy of the payloads to pinned host memory, or,
    with on_host False, none: the payloads stay on the GPU, for a caller that copies them
    straight into their destination)."""
    check_codec(codec)
    if codec not in BATCHED or blocks.device.type == "cpu" or blocks.shape[0] == 0:
        return [encode(codec, b) for b in blocks]
    if not blocks.dtype.is_floating_point:
        raise CodecError(f"codec {codec} needs a floating-point KV dtype, not {blocks.dtype}")
    if len(blocks.shape) != 6 and codec == "int4":
        raise CodecError(f"int4 needs blocks [n, layers, 2, tokens, heads, dim], not {list(blocks.shape)}")
    payloads = BATCHED[codec](blocks.detach())
    if not on_host:
        return list(payloads)
    host = torch.empty(payloads.shape, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    host.copy_(payloads)
    return list(host)


def _f16(u8: torch.Tensor) -> torch.Tensor:
    """Bytes [n, 2k] as fp16 [n, k] (copied when not contiguous or at an odd offset)."""
    t = u8.contiguous()
    if t.storage_offset() % 2 or t.stride(0) != t.shape[1]:  # a one-row slice counts as contiguous
        t = torch.empty(t.shape, dtype=torch.uint8, device=t.device).copy_(t)
    return t.view(torch.float16)


def _rows_decode_batch(payloads: torch.Tensor, shape, dtype, qtype: torch.dtype) -> torch.Tensor:
    """int8 / fp8 payloads [n, bytes] -> blocks [n, *shape]: an fp16 scale per row of
    head_dim values, then a byte per value; q * scale in fp32, rounded once to `dtype`
    (the C loops' arithmetic)."""
    n, rows = payloads.shape[0], math.prod(shape[:-1])
    scale = _f16(payloads[:, : 2 * rows]).reshape(n, *shape[:-1], 1)
    q = payloads[:, 2 * rows : 2 * rows + math.prod(shape)].view(qtype).reshape(n, *shape)
    return (q.float() * scale.float()).to(dtype)


def _int4_decode_batch(payloads: torch.Tensor, shape, dtype) -> torch.Tensor:
    """int4 payloads [n, bytes] -> blocks [n, L, 2, T, H, D] (_int4_decode's arithmetic:
    q * scale, then + min, in fp32)."""
    n = payloads.shape[0]
    L, _, T, H, D = shape
    gk, Gk, gv, Gv, sizes = _int4_layout(shape)
    at = _section_ptrs(0, sizes)
    section = [payloads[:, a : a + size] for a, size in zip(at, sizes, strict=True)]
    out = torch.empty((n, *shape), dtype=torch.float32, device=payloads.device)
    for which, (lead, axis, g, groups) in enumerate((((L, H, D), T, gk, Gk), ((L, T, H), D, gv, Gv))):
        scale_u8, lo_u8, packed = section[3 * which : 3 * which + 3]
        scale = _f16(scale_u8).reshape(n, *lead, groups, 1).float()
        lo = _f16(lo_u8).reshape(n, *lead, groups, 1).float()
        q = torch.empty((n, 2 * packed.shape[1]), dtype=torch.uint8, device=payloads.device)
        q[:, 0::2] = packed & 0x0F
        q[:, 1::2] = packed >> 4
        count = math.prod(lead) * groups * g
        x = q[:, :count].float().reshape(n, *lead, groups, g) * scale + lo
        x = x.reshape(n, *lead, groups * g)[..., :axis]
        if which == 0:
            out[:, :, 0] = x.permute(0, 1, 4, 2, 3)  # [n, L, H, D, T] -> [n, L, T, H, D]
        else:
            out[:, :, 1] = x
    return out.to(dtype)


DECODE_BATCHED: dict[str, Callable[[torch.Tensor, tuple, torch.dtype], torch.Tensor]] = {
    "int8": lambda p, shape, dtype: _rows_decode_batch(p, shape, dtype, torch.int8),
    "int4": _int4_decode_batch,
}
if FP8 is not None:  # a torch without float8 decodes fp8 with the C loops only
    DECODE_BATCHED["fp8"] = functools.partial(_rows_decode_batch, qtype=FP8)


def payload_bytes(codec: str, shape, dtype: torch.dtype) -> int:
    """The size of a lossy codec's payload for a block of `shape` (fixed by the shape)."""
    if codec == "int4":
        return sum(_int4_layout(shape)[4])
    if codec in ("int8", "fp8"):
        return 2 * math.prod(shape[:-1]) + math.prod(shape)
    if codec == "none":
        return math.prod(shape) * dtype.itemsize
    raise CodecError(f"codec {codec} has no fixed payload size")


def max_payload_bytes(codec: str, shape, dtype: torch.dtype) -> int:
    """The most a block of `shape` can take in `codec`: its fixed size, or for zstd the
    library's worst case (ZSTD_compressBound) plus room for the frame header."""
    if codec != "zstd":
        return payload_bytes(codec, shape, dtype)
    n = payload_bytes("none", shape, dtype)
    return n + (n >> 8) + ((((128 << 10) - n) >> 11) if n < (128 << 10) else 0) + 64


def decode_batch(codec: str, payloads: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """Payloads [n, bytes] of one lossy codec, on any device -> blocks [n, *shape] there:
    a promotion to the GPU copies the smaller payloads across and decodes them on the
    GPU, a few kernels for n blocks (the same values as decode(), which runs on the host)."""
    check_codec(codec)
    if codec == "fp8" and FP8 is None:
        raise CodecError("this torch build has no float8_e4m3fn")
    if codec not in DECODE_BATCHED:
        raise CodecError(f"codec {codec} has no batched decode")
    if codec == "int4" and len(shape) != 5:
        raise CodecError(f"int4 needs blocks [layers, 2, tokens, heads, dim], not {list(shape)}")
    if payloads.dim() != 2 or payloads.dtype != torch.uint8:
        raise CodecError(f"payloads must be uint8 [n, bytes], not {payloads.dtype} {list(payloads.shape)}")
    if payloads.shape[1] < payload_bytes(codec, shape, dtype):
        raise CodecError("payload is truncated")
    return DECODE_BATCHED[codec](payloads, tuple(shape), dtype)


def decode(codec: str, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of encode; raises CodecError when the payload does not fit the shape."""
    check_codec(codec)
    payload = payload.reshape(-1).to("cpu")
    if codec == "none":
        if payload.numel() != payload_bytes("none", shape, dtype):
            raise CodecError("payload has the wrong size")
        return payload.view(dtype).reshape(shape)
    if codec in LOSSY and (codec != "int4" or len(shape) == 5):
        # a fixed size: a longer payload is another layout's (its leading bytes would decode
        # as this one's, wrong values and no error)
        if payload.numel() != payload_bytes(codec, shape, dtype):
            raise CodecError(
                "payload is truncated"
                if payload.numel() < payload_bytes(codec, shape, dtype)
                else "payload has the wrong size"
            )
    return CODECS[codec][1](payload, tuple(shape), dtype)
