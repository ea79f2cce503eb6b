"""Block codecs: round trips on random blocks of several shapes and dtypes, the error
bound each lossy codec promises, int4 packing, size ratios on a realistic block, and
bad payloads. A block is [num_layers, 2, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core import codecs
from tests.tiers.support import block, fp8_bound, int4_bound, int4_group_len, int8_bound, roundtrip

DTYPES = [torch.float16, torch.float32, torch.bfloat16]
SHAPES = [
    (1, 2, 4, 1, 8),
    (2, 2, 16, 2, 64),
    (1, 2, 5, 3, 7),  # odd everywhere: int4 sections of odd length
    (1, 2, 130, 1, 3),  # block_size past one int4 group of 128 tokens
    (1, 2, 3, 2, 129),  # head_dim past one int4 group of 128 channels
]
LOSSLESS = ["none", "zstd"]
FP8_MISSING = getattr(torch, "float8_e4m3fn", None) is None


# ---- round trips ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("codec", LOSSLESS)
def test_lossless_codecs_are_exact(codec, shape, dtype):
    x = block(shape, dtype)
    assert torch.equal(roundtrip(codec, x), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_error_is_at_most_half_a_row_scale(shape, dtype):
    x = block(shape, dtype, seed=1)
    err = (roundtrip("int8", x).float() - x.float()).abs()
    assert torch.all(err <= int8_bound(x)), f"max excess {(err - int8_bound(x)).max().item()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int4_error_is_at_most_half_a_group_scale(shape, dtype):
    x = block(shape, dtype, seed=2)
    err = (roundtrip("int4", x).float() - x.float()).abs()
    assert torch.all(err <= int4_bound(x)), f"max excess {(err - int4_bound(x)).max().item()}"


@pytest.mark.skipif(FP8_MISSING, reason="this torch build has no float8_e4m3fn")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp8_relative_error(shape, dtype):
    x = block(shape, dtype, seed=3)
    err = (roundtrip("fp8", x).float() - x.float()).abs()
    assert torch.all(err <= fp8_bound(x)), f"max excess {(err - fp8_bound(x)).max().item()}"


def test_fp8_is_skipped_where_torch_lacks_it():
    if FP8_MISSING:
        assert "fp8" not in codecs.available_codecs()
        with pytest.raises(codecs.CodecError, match="unknown codec 'fp8'"):
            codecs.check_codec("fp8")
        pytest.skip("this torch build has no float8_e4m3fn")
    assert "fp8" in codecs.available_codecs()


def lossy() -> list[str]:
    return [c for c in ("int8", "int4", "fp8") if c in codecs.available_codecs()]


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("kind", ["zeros", "constant", "outlier", "large"])
def test_lossy_codecs_on_degenerate_blocks(codec, kind):
    if codec not in codecs.available_codecs():
        pytest.skip(f"{codec} unavailable in this torch build")
    shape = (1, 2, 5, 2, 9)
    if kind == "zeros":
        x = torch.zeros(shape, dtype=torch.float16)
    elif kind == "constant":
        x = torch.full(shape, -3.25, dtype=torch.float16)
    elif kind == "outlier":
        x = block(shape, torch.float16, seed=4)
        x[0, 0, 2, 1, 4] = 300.0
    else:  # near the fp16 range: scales must not overflow
        x = block(shape, torch.float16, seed=5, magnitude=20000.0).clamp(-60000, 60000)
    y = roundtrip(codec, x)
    assert torch.isfinite(y.float()).all()
    bound = {"int8": int8_bound, "int4": int4_bound, "fp8": fp8_bound}[codec](x)
    assert torch.all((y.float() - x.float()).abs() <= bound)
    if kind in ("zeros", "constant") and codec != "fp8":
        assert torch.equal(y, x)


@settings(max_examples=15, deadline=None)
@given(
    dims=st.tuples(st.integers(1, 2), st.integers(1, 9), st.integers(1, 3), st.integers(1, 17)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    magnitude=st.sampled_from([1e-3, 1.0, 50.0]),
)
def test_random_shapes_keep_every_bound(dims, dtype, seed, magnitude):
    L, T, H, D = dims
    x = block((L, 2, T, H, D), dtype, seed=seed, magnitude=magnitude)
    for codec in LOSSLESS:
        assert torch.equal(roundtrip(codec, x), x)
    bounds = {"int8": int8_bound, "int4": int4_bound, "fp8": fp8_bound}
    for codec in lossy():
        err = (roundtrip(codec, x).float() - x.float()).abs()
        assert torch.all(err <= bounds[codec](x)), codec


# ---- sizes and packing --------------------------------------------------------------
def int4_payload_bytes(shape) -> int:
    """fp16 scale + fp16 minimum per group, then the packed 4-bit values (padded to whole
    groups), two per byte; keys first, then values."""
    L, _, T, H, D = shape
    total = 0
    for lead, axis in ((L * H * D, T), (L * T * H, D)):
        g = int4_group_len(axis)
        n_groups = lead * math.ceil(axis / g)
        total += n_groups * 2 * 2 + math.ceil(n_groups * g / 2)
    return total


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_payload_sizes(shape):
    x = block(shape, torch.float16)
    n = math.prod(shape)
    assert codecs.encode("none", x).numel() == 2 * n
    assert codecs.encode("int8", x).numel() == n + 2 * (n // shape[-1])
    assert codecs.encode("int4", x).numel() == int4_payload_bytes(shape)
    if "fp8" in codecs.available_codecs():
        assert codecs.encode("fp8", x).numel() == n + 2 * (n // shape[-1])


def test_int4_packs_two_values_per_byte():
    # one token, one head: the values row 0..15 is one group with minimum 0 and scale 1,
    # so its 4-bit codes are the values themselves, low nibble first
    x = torch.zeros((1, 2, 1, 1, 16), dtype=torch.float16)
    x[0, 1, 0, 0] = torch.arange(16, dtype=torch.float16)
    payload = codecs.encode("int4", x)
    packed = payload[-8:].tolist()
    assert packed == [(2 * i) | ((2 * i + 1) << 4) for i in range(8)]
    assert torch.equal(codecs.decode("int4", payload, x.shape, x.dtype), x)


def test_size_ratios_on_a_realistic_block():
    shape = (4, 2, 256, 4, 128)
    x = block(shape, torch.float16, seed=6)
    raw = x.numel() * 2
    ratios = {c: raw / codecs.encode(c, x).numel() for c in lossy()}
    assert ratios["int8"] >= 1.9
    assert ratios["int4"] >= 3.5
    if "fp8" in ratios:
        assert ratios["fp8"] >= 1.9
    assert codecs.encode("int4", x).numel() == int4_payload_bytes(shape)


def test_zstd_shrinks_a_redundant_block():
    x = torch.zeros((2, 2, 16, 2, 64), dtype=torch.float16)
    x[..., :4] = 1.0
    assert codecs.encode("zstd", x).numel() < x.numel() * 2 / 10


def test_encode_takes_any_strides_and_leaves_the_input_alone():
    base = block((1, 2, 4, 3, 8), torch.float32, seed=7)
    x = base.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not x.is_contiguous()
    before = x.clone()
    for codec in codecs.available_codecs():
        y = roundtrip(codec, x)
        assert torch.equal(x, before)
        if codec in LOSSLESS:
            assert torch.equal(y, base)


# ---- bad input ----------------------------------------------------------------------
@pytest.mark.parametrize("cut", [1, 2, "half", "all"])
@pytest.mark.parametrize("codec", ["none", "int8", "int4", "fp8", "zstd"])
def test_truncated_payload_is_a_codec_error(codec, cut):
    if codec not in codecs.available_codecs():
        pytest.skip(f"{codec} unavailable in this torch build")
    shape = (1, 2, 5, 3, 7)
    payload = codecs.encode(codec, block(shape, torch.float16))
    keep = {"half": payload.numel() // 2, "all": 0}.get(cut, payload.numel() - (cut if isinstance(cut, int) else 0))
    with pytest.raises(codecs.CodecError):
        codecs.decode(codec, payload[:keep], shape, torch.float16)


def test_payload_of_another_shape_is_a_codec_error():
    payload = codecs.encode("none", block((1, 2, 4, 1, 8), torch.float16))
    with pytest.raises(codecs.CodecError, match="wrong size"):
        codecs.decode("none", payload, (1, 2, 4, 1, 16), torch.float16)
    z = codecs.encode("zstd", block((1, 2, 4, 1, 8), torch.float16))
    with pytest.raises(codecs.CodecError, match="wrong size"):
        codecs.decode("zstd", z, (1, 2, 4, 1, 4), torch.float16)


def test_corrupt_zstd_payload_is_a_codec_error():
    payload = codecs.encode("zstd", block((1, 2, 4, 1, 8), torch.float16)).clone()
    payload[:4] = 0  # the frame magic
    with pytest.raises(codecs.CodecError, match="zstd"):
        codecs.decode("zstd", payload, (1, 2, 4, 1, 8), torch.float16)


@pytest.mark.parametrize("call", ["encode", "decode", "check"])
def test_unknown_codec_names_the_choices(call):
    x = block((1, 2, 4, 1, 8), torch.float16)
    with pytest.raises(codecs.CodecError) as info:
        if call == "encode":
            codecs.encode("lz4", x)
        elif call == "decode":
            codecs.decode("lz4", codecs.encode("none", x), x.shape, x.dtype)
        else:
            codecs.check_codec("lz4")
    msg = str(info.value)
    assert "'lz4'" in msg
    for name in codecs.available_codecs():
        assert name in msg


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_lossy_codecs_refuse_integer_blocks(codec):
    if codec not in codecs.available_codecs():
        pytest.skip(f"{codec} unavailable in this torch build")
    with pytest.raises(codecs.CodecError, match="floating-point"):
        codecs.encode(codec, torch.zeros((1, 2, 4, 1, 8), dtype=torch.int8))


# ---- the C loops (agent/core/codec_kernel.c) ---------------------------------------
def _torch_only(monkeypatch, fn):
    """Run fn with the C loops off (torch computes the same arithmetic)."""
    monkeypatch.setattr(codecs, "_native", lambda: None)
    return fn()


C_SHAPES = [
    *SHAPES,
    (2, 2, 16, 4, 128),
    (1, 2, 3, 1, 17),
    (1, 2, 300, 2, 5),
    (3, 2, 129, 2, 257),
    (1, 2, 16, 1, 1),
    (1, 2, 100, 2, 40),  # int4 key pairs transposed 16 x 16 at a time, with row and column tails
    (2, 2, 256, 4, 64),  # the benchmark's layout: two key groups, all in 16 x 16 tiles
]


@pytest.mark.parametrize("shape", C_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "zeros", "signed_zeros", "huge", "mixed", "tiny"])
@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_c_loops_match_torch_bit_for_bit(codec, shape, kind, monkeypatch):
    """Odd token counts and head_dims (int4 nibbles straddling groups), several int4 key
    groups with the last token repeated and value groups with the last channel repeated,
    values near fp16's largest and in e4m3's subnormals; a strided block."""
    if codecs._native() is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    if codec not in codecs.available_codecs():
        pytest.skip(f"{codec} unavailable in this torch build")
    x = block(shape, torch.float16)
    if kind == "zeros":
        x = torch.zeros(shape, dtype=torch.float16)
    elif kind == "huge":  # int4 decodes q * scale + min: keep that finite
        top = 3e4 if codec == "int4" else 6e4
        x = (x.float() * (top / x.float().abs().max().clamp_min(1e-3))).half()
    elif kind == "mixed":
        x[..., ::3] = 0
        x[..., 1::5] *= 1000
    elif kind == "tiny":
        x = (x.float() * 1e-3).half()
        x[..., 0] = 1.0
    elif kind == "signed_zeros":  # groups whose minimum is +0 in some places and -0 in others
        x = x.abs()
        x[..., 0::3] = 0.0
        x[..., 1::3] = -0.0
        odd = x[:, :, 1::2]
        x[:, :, 1::2] = torch.where(odd == 0, -odd, odd)
    x = x.transpose(2, 3).contiguous().transpose(2, 3)  # strided input: encoded as a copy
    native_payload = codecs.encode(codec, x)
    torch_payload = _torch_only(monkeypatch, lambda: codecs.encode(codec, x))
    assert torch.equal(native_payload, torch_payload)
    monkeypatch.undo()
    native_back = codecs.decode(codec, native_payload, shape, torch.float16)
    torch_back = _torch_only(monkeypatch, lambda: codecs.decode(codec, native_payload, shape, torch.float16))
    assert torch.equal(native_back, torch_back)
    monkeypatch.undo()
    with pytest.raises(codecs.CodecError, match="truncated"):
        codecs.decode(codec, native_payload[:-1], shape, torch.float16)


def test_fp8_c_conversion_of_every_fp16_value_matches_torch(monkeypatch):
    """Rows of 15 values and 448: the scale is exactly 1, so each payload byte is the e4m3
    of the value itself (8 at a time, then one by one): every finite fp16 in e4m3's range,
    ties and subnormals included."""
    if codecs._native() is None or codecs.FP8 is None:
        pytest.skip("no C compiler or no float8 in this torch")
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    every = every[torch.isfinite(every) & (every.float().abs() <= 448)]
    every = torch.cat([every, every[: (-len(every)) % 30]]).reshape(-1, 15)
    x = torch.cat([every, torch.full((len(every), 1), 448.0, dtype=torch.float16)], dim=1).reshape(-1, 2, 1, 1, 16)
    native_payload = codecs.encode("fp8", x)
    assert torch.equal(native_payload, _torch_only(monkeypatch, lambda: codecs.encode("fp8", x)))


@pytest.mark.parametrize("scale", [1.0, 0.3333, 65504.0, 6e-8])
def test_fp8_c_decode_of_every_byte_matches_torch(scale, monkeypatch):
    """Every e4m3 byte (normals, subnormals, both zeros, both NaNs) times a scale that is
    exact, inexact, huge (overflows to infinity in fp16) and tiny: the same fp16 bits as
    torch, 8 at a time (rows of 16) and one by one (rows of 3)."""
    if codecs._native() is None or codecs.FP8 is None:
        pytest.skip("no C compiler or no float8 in this torch")
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for d in (16, 3):
        q = torch.cat([every, every[: (-len(every)) % d]])
        shape = (len(q) // d, 1, 1, 1, d)
        scales = torch.full((len(q) // d,), scale, dtype=torch.float16)
        payload = torch.cat([scales.view(torch.uint8), q])
        native = codecs.decode("fp8", payload, shape, torch.float16)
        reference = _torch_only(
            monkeypatch, lambda payload=payload, shape=shape: codecs.decode("fp8", payload, shape, torch.float16)
        )
        monkeypatch.undo()
        assert torch.equal(native.view(torch.int16), reference.view(torch.int16))


def test_int8_c_loops_build_where_a_compiler_is(monkeypatch):
    import shutil

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    assert codecs._native() is not None, "agent/core/codec_kernel.c did not build (see the log)"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_a_batch_encodes_to_each_blocks_own_payload(codec, shape, dtype):
    """The batched path (what a GPU demotion runs over many blocks at once; here on the
    host) writes for every block the bytes encode() writes for it alone."""
    if codec not in codecs.available_codecs():
        pytest.skip(f"{codec} unavailable in this torch build")
    blocks = torch.stack([block(shape, dtype, seed=i, magnitude=1 + 10 * i) for i in range(3)])
    blocks[1, ..., 0] = 0
    batch = codecs.BATCHED[codec](blocks)
    assert batch.shape[0] == 3
    for i in range(3):
        assert torch.equal(batch[i], codecs.encode(codec, blocks[i])), f"block {i}"
    assert [p.numel() for p in codecs.encode_batch(codec, blocks)] == [batch.shape[1]] * 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_a_batch_decodes_to_each_payloads_own_block(codec, shape, dtype):
    """The batched decode (what a promotion into the GPU runs there; here on the host)
    gives every payload the very block decode() gives it alone."""
    if codec not in codecs.available_codecs():
        pytest.skip(f"{codec} unavailable in this torch build")
    blocks = torch.stack([block(shape, dtype, seed=i, magnitude=1 + 10 * i) for i in range(3)])
    blocks[1, ..., 0] = 0
    payloads = torch.stack([codecs.encode(codec, b) for b in blocks])
    assert payloads.shape[1] == codecs.payload_bytes(codec, shape, dtype)
    out = codecs.decode_batch(codec, payloads, shape, dtype)
    assert out.shape == (3, *shape) and out.dtype == dtype
    for i in range(3):
        assert torch.equal(out[i], codecs.decode(codec, payloads[i], shape, dtype)), f"block {i}"


@pytest.mark.parametrize(
    "codec, payloads, why",
    [
        ("int8", torch.zeros((2, 10), dtype=torch.uint8), "truncated"),
        ("int8", torch.zeros((2, 5000), dtype=torch.float16), "uint8"),
        ("int8", torch.zeros(5000, dtype=torch.uint8), "uint8 \\[n, bytes\\]"),
        ("zstd", torch.zeros((2, 5000), dtype=torch.uint8), "no batched decode"),
        ("lz4", torch.zeros((2, 5000), dtype=torch.uint8), "unknown codec"),
    ],
)
def test_batched_decode_names_what_is_wrong(codec, payloads, why):
    with pytest.raises(codecs.CodecError, match=why):
        codecs.decode_batch(codec, payloads, (1, 2, 16, 2, 64), torch.float16)


# ---- values the fp16 scales cannot hold ------------------------------------------------
@pytest.mark.parametrize(
    "dtype, magnitude, codec",
    [
        (torch.bfloat16, 1e5, "int4"),  # minimums past fp16's 65504
        (torch.bfloat16, 1e7, "int8"),  # scales past 65504 (x / 127)
        (torch.float32, 1e8, "fp8"),  # scales past 65504 (x / 448)
        (torch.float16, math.inf, "int8"),  # an inf in an fp16 row (the C loops)
        (torch.float16, math.inf, "fp8"),
        (torch.float16, math.inf, "int4"),
        (torch.bfloat16, math.nan, "int8"),
        (torch.float16, math.nan, "int8"),  # a NaN in an fp16 row (the C loops' scales keep it)
        (torch.float16, math.nan, "fp8"),
        (torch.float16, math.nan, "int4"),
    ],
    ids=str,
)
def test_a_lossy_codec_refuses_a_block_its_fp16_scales_cannot_hold(dtype, magnitude, codec):
    """Encoded, such a block would decode to inf/NaN with no error anywhere: the codec
    refuses it (the pool then keeps it uncompressed, or the move fails and it stays)."""
    if codec == "fp8" and FP8_MISSING:
        pytest.skip("no float8_e4m3fn in this torch")
    x = block((1, 2, 4, 1, 8), dtype).float()
    x[0, 0, 1, 0, 3] = magnitude if not math.isfinite(magnitude) else x[0, 0, 1, 0, 3] * magnitude
    if math.isfinite(magnitude):
        x = x * magnitude
    x = x.to(dtype)
    with pytest.raises(codecs.CodecError, match="fp16 scales"):
        codecs.encode(codec, x)
    with pytest.raises(codecs.CodecError, match="fp16 scales"):
        codecs.encode_batch(codec, x[None])


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("head_dim", [8, 12, 64])
def test_one_nan_anywhere_in_an_fp16_block_is_refused_by_every_loop(codec, head_dim):
    """A NaN in any row, at any place of it (the vector body, a row's tail past a
    multiple of 8, the 8-row batches and the rows after them; a key or a value group for
    int4) makes the block's scales NaN: refused, never encoded as finite values."""
    if codec == "fp8" and FP8_MISSING:
        pytest.skip("no float8_e4m3fn in this torch")
    shape = (2, 2, 5, 3, head_dim)  # 30 rows: 3 batches of 8 and 6 rows after
    base = block(shape, torch.float16)
    codecs.encode(codec, base)  # finite: encoded
    rng = random.Random(head_dim)
    places = {
        (layer, kv, t, h, d)
        for layer in range(2)
        for kv in range(2)
        for t in (0, 4)
        for h in (0, 2)
        for d in (0, head_dim - 1)
    }
    places |= {tuple(rng.randrange(n) for n in shape) for _ in range(12)}
    for where in sorted(places):
        x = base.clone()
        x[where] = math.nan
        with pytest.raises(codecs.CodecError, match="fp16 scales"):
            codecs.encode(codec, x)


def test_a_block_a_tiers_codec_cannot_hold_is_stored_uncompressed_and_a_move_with_it_fails(tmp_path):
    from agent.core.block_pool import BlockPool
    from agent.core.engine_api import KVEngineAPI
    from agent.core.model_spec import ModelSpec
    from agent.store.disk_tier import DiskTier
    from agent.store.memory_tier import MemoryTier
    from protos.tier import Tier

    spec = ModelSpec("m", block_size=4, num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    cpu = MemoryTier(Tier.CPU, 8 * spec.block_bytes, spec.block_bytes, device="cpu")
    pool = BlockPool([cpu, DiskTier(tmp_path, 1 << 20)], [spec], tier_codecs={Tier.CPU: "int8"})
    e = KVEngineAPI(pool, [spec])
    big = (torch.randn((2, *spec.block_shape), generator=torch.Generator().manual_seed(0)) * 1e7).to(torch.bfloat16)
    toks = list(range(8))
    assert e.store("m", toks, big).num_stored_blocks == 2
    hs = e.hashes(spec, toks)
    assert [pool.blocks[h].codec for h in hs] == ["none", "none"]
    assert any(n.kind == "codec_refused" for n in pool.drain_notices())
    assert torch.equal(e.load("m", toks).kv, big)
    out = pool.move_blocks(hs[1:], Tier.DISK, "int4")
    assert not out[0].ok and pool.tier_of(hs[1]) is Tier.CPU
    assert torch.equal(e.load("m", toks).kv, big)


def test_the_demo_workloads_blocks_survive_every_codec_so_a_mismatch_is_corruption():
    """The workload checks every loaded block byte for byte; the demo compresses a
    namespace with int8. Its fill values are those every codec keeps exactly (some
    integers int8 or fp8 round are left out), so a mismatch it counts is real."""
    from agent.server import DEMO_MODEL
    from benchmarks.workload import _codec_exact_fills, block_fill

    fills = _codec_exact_fills()
    assert 1500 < len(fills) < 2048
    for h in (bytes([i, 7 * i % 256]) + bytes(14) for i in range(0, 256, 5)):
        x = torch.full(DEMO_MODEL.block_shape, block_fill(h), dtype=torch.float16)
        for codec in codecs.available_codecs():
            assert torch.equal(codecs.decode(codec, codecs.encode(codec, x), x.shape, x.dtype), x), (codec, h)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_an_fp16_block_at_the_top_of_its_range_is_refused_not_decoded_to_inf(codec):
    """±65504: int8's scale rounds up in fp16 (127 x 516 = 65532), which decodes to inf;
    refused on the C path and torch's alike. 60000 goes through, finite."""
    if codec not in codecs.available_codecs():
        pytest.skip(f"{codec} unavailable in this torch build")
    x = block((1, 2, 4, 1, 8), torch.float16)
    x[0, 0, 0, 0, 0], x[0, 1, 1, 0, 1] = 65504.0, -65504.0
    with pytest.raises(codecs.CodecError, match="fp16 scales"):
        codecs.encode(codec, x)
    x[0, 0, 0, 0, 0], x[0, 1, 1, 0, 1] = 60000.0, -60000.0
    assert torch.isfinite(roundtrip(codec, x).float()).all()


# ---- a review's edge cases (2026-12-06) --------------------------------------------------
@pytest.mark.parametrize("path", ["c", "torch"])
def test_int4_refuses_an_fp16_group_that_would_decode_to_inf_on_both_paths(path, monkeypatch):
    """A value group [65504, 0, ...]: its scale 65504/15 rounds up in fp16 to 4368, and
    15 x 4368 = 65520 is inf in fp16. The C loop refused it; the torch path (GPU blocks,
    encode_batch, agents without a C compiler) checked the fp32 copy's dtype and let it
    through, to load as inf."""
    if path == "torch":
        monkeypatch.setattr(codecs, "_native", lambda: None)
    x = torch.zeros((1, 2, 4, 1, 8), dtype=torch.float16)
    x[0, 1, 0, 0, 0] = 65504.0
    with pytest.raises(codecs.CodecError, match="fp16 scales"):
        codecs.encode("int4", x)
    with pytest.raises(codecs.CodecError, match="fp16 scales"):
        codecs.BATCHED["int4"](x[None])


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_a_lossy_payload_of_another_size_is_refused_not_decoded(codec):
    """decode() promises a CodecError for a payload that does not fit the shape: the lossy
    codecs checked only that it was not short, and read a longer one's leading bytes."""
    big = torch.randn((1, 2, 4, 1, 16)).half()
    payload = codecs.encode(codec, big)
    with pytest.raises(codecs.CodecError, match="wrong size"):
        codecs.decode(codec, payload, (1, 2, 4, 1, 8), torch.float16)
    with pytest.raises(codecs.CodecError, match="truncated"):
        codecs.decode(codec, payload[:-1], (1, 2, 4, 1, 16), torch.float16)
    assert codecs.decode(codec, payload, (1, 2, 4, 1, 16), torch.float16).shape == big.shape


@pytest.mark.skipif(getattr(torch, "float8_e4m3fn", None) is None, reason="no float8_e4m3fn")
@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_a_tier_codec_no_smaller_than_an_fp8_kv_block_is_not_used(codec):
    """--cpu-codec int8|fp8 on an fp8 KV cache stored a byte a value plus the scales:
    bigger than the raw block (saved bytes negative) and re-quantized. Such a block enters
    the tier as it is, bit-exact."""
    from agent.core.block_pool import BlockPool
    from agent.core.engine_api import KVEngineAPI
    from agent.core.model_spec import ModelSpec
    from agent.store.memory_tier import MemoryTier
    from protos.tier import Tier

    spec = ModelSpec("m", block_size=16, num_layers=1, num_kv_heads=2, head_dim=64, dtype="float8_e4m3fn")
    cpu = MemoryTier(Tier.CPU, 8 * spec.block_bytes, spec.block_bytes // 16, device="cpu")
    pool = BlockPool([cpu], [spec], tier_codecs={Tier.CPU: codec})
    e = KVEngineAPI(pool, [spec])
    kv = (torch.randn((2, *spec.block_shape), generator=torch.Generator().manual_seed(0)) * 4).to(torch.float8_e4m3fn)
    toks = list(range(2 * spec.block_size))
    assert e.store("m", toks, kv).num_stored_blocks == 2
    metas = [pool.blocks[h] for h in e.hashes(spec, toks)]
    assert [m.codec for m in metas] == ["none", "none"]
    assert all(m.stored_bytes == m.num_bytes for m in metas)
    assert next(u for u in pool.usage() if u.tier is Tier.CPU).saved_bytes == 0
    assert torch.equal(e.load("m", toks).kv.view(torch.uint8), kv.view(torch.uint8))


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("codec, qmax, amax", [("int8", 127.0, 1e-4), ("int8", 127.0, 3e-4), ("fp8", 448.0, 3e-5)])
def test_a_row_whose_scale_is_an_fp16_subnormal_keeps_the_codecs_precision(path, codec, qmax, amax, monkeypatch):
    """Values were quantized with the fp32 scale and decoded with its fp16 rounding: a row
    of amax 1e-4 came back 3.7 % off in int8 (9.5x half a step), one of 3e-5 40 % off in
    fp8 (a review). They are quantized with the stored scale (a subnormal rounded up)."""
    if path == "torch":
        monkeypatch.setattr(codecs, "_native", lambda: None)
    if codec == "fp8" and codecs.FP8 is None:
        pytest.skip("no float8_e4m3fn")
    x = (torch.linspace(-1, 1, 64) * amax).reshape(1, 2, 4, 1, 8).half()
    payload = codecs.encode(codec, x)
    y = codecs.decode(codec, payload, x.shape, x.dtype)
    stored = payload[: 2 * 8].view(torch.float16).float().reshape(1, 2, 4, 1, 1)
    scale = x.float().abs().amax(dim=-1, keepdim=True) / qmax
    assert torch.all(stored >= scale)  # rounded up: x / it stays within qmax
    err = (y.float() - x.float()).abs()
    if codec == "int8":
        bound = stored / 2 + 2.0**-25
    else:
        bound = x.float().abs() * 2.0**-4 + stored * 2.0**-10 + 2.0**-25
    assert torch.all(err <= bound), f"max error {err.max().item():.3g} ({err.max().item() / amax:.1%} of amax)"
