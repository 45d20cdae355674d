"""Value types: CacheShape, CacheConfig, Precision, BlockFormat, TokenLayout,
PrecisionPlan."""

import mixkv
import pytest
from helpers import P, layout, plan_of


def test_precision_is_the_pool_index():
    assert [int(p) for p in (P.FP16, P.INT4, P.INT2)] == [0, 1, 2]
    assert [mixkv.bits_of(p) for p in P] == [16, 4, 2]
    assert [mixkv.is_quantized(p) for p in P] == [False, True, True]


def test_cache_shape_fields_and_validation():
    shape = mixkv.CacheShape(num_layers=3, num_kv_heads=4, head_dim=128)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.block_size) == (3, 4, 128, 32)
    shape.validate()
    assert shape == mixkv.CacheShape(3, 4, 128, 32)
    assert "head_dim=128" in repr(shape)
    with pytest.raises(ValueError, match="head_dim"):
        mixkv.CacheShape(1, 1, 100).validate()
    with pytest.raises(ValueError, match="block_size"):
        mixkv.CacheShape(1, 1, 64, 24).validate()
    with pytest.raises(ValueError, match="num_layers"):
        mixkv.CacheShape(0, 1, 64).validate()


def test_cache_config_defaults():
    config = mixkv.CacheConfig(mixkv.CacheShape(1, 1, 64), arena_bytes=1 << 24)
    assert config.slab_bytes == 2 << 20
    assert config.shape.head_dim == 64


def test_block_format_bytes_match_the_design():
    # D = 128, S = 32: FP16 512, INT4 148, INT2 84 bytes per token per head.
    for p, per_token in ((P.FP16, 512), (P.INT4, 148), (P.INT2, 84)):
        fmt = mixkv.BlockFormat(p, num_kv_heads=4, head_dim=128, block_size=32)
        assert fmt.head_bytes == per_token * 32
        assert fmt.block_bytes == 4 * per_token * 32
        assert mixkv.bytes_per_token_per_head(p, 128, 32) == per_token
    int4 = mixkv.BlockFormat(P.INT4, 1, 128, 32)
    assert (int4.k_channel_bytes, int4.v_token_bytes, int4.bits) == (16, 64, 4)
    assert int4.v_offset == 16 * 128 and int4.k_params_offset == int4.v_offset + 64 * 32
    k0 = int4.k_params_offset
    assert [int4.k_min_offset(c) - k0 for c in (0, 1, 8, 2, 16)] == [0, 2, 8, 16, 64]
    assert [int4.k_scale_offset(c) - k0 for c in (0, 1, 127)] == [4, 6, 63 * 8 + 6]
    assert (int4.v_scale_offset(2), int4.v_min_offset(2)) == (int4.v_params_offset + 8, int4.v_params_offset + 10)
    with pytest.raises(ValueError, match="k_scale_offset: channel = 128: expected in \\[0, 128\\)"):
        int4.k_scale_offset(128)
    with pytest.raises(ValueError, match="v_min_offset: token = -1"):
        int4.v_min_offset(-1)
    with pytest.raises(ValueError, match="k_min_offset: precision FP16: expected INT4 or INT2"):
        mixkv.BlockFormat(P.FP16, 1, 128, 32).k_min_offset(0)


def test_block_format_k_code_bytes():
    P = mixkv.Precision
    int4 = mixkv.BlockFormat(P.INT4, 1, 128, 32)  # 16-byte channels, contiguous
    assert not int4.k_runs_are_bytes
    assert [int4.k_code_byte(c, i) for c, i in ((0, 0), (0, 15), (3, 2))] == [0, 15, 50]
    int2 = mixkv.BlockFormat(P.INT2, 1, 128, 32)  # one-byte runs, run-major by 16 channels
    assert int2.k_runs_are_bytes
    # channels 0, 8, 1, 9 of run 0 are one word; run 1 starts 16 bytes on; channel 16 opens group 1
    assert [int2.k_code_byte(c, 0) for c in (0, 8, 1, 9, 2)] == [0, 1, 2, 3, 4]
    assert (int2.k_code_byte(0, 1), int2.k_code_byte(16, 0), int2.k_code_byte(127, 7)) == (
        16,
        128,
        7 * 128 + 7 * 16 + 15,
    )
    offsets = {int2.k_code_byte(c, i) for c in range(128) for i in range(int2.k_channel_bytes)}
    assert offsets == set(range(int2.v_offset))  # the layout tiles the K codes exactly
    with pytest.raises(ValueError, match="k_code_byte: i = 8: expected in \\[0, k_channel_bytes = 8\\)"):
        int2.k_code_byte(0, 8)
    with pytest.raises(ValueError, match="k_code_byte: channel = -1"):
        int2.k_code_byte(-1, 0)
    with pytest.raises(ValueError, match="k_code_byte: precision FP16"):
        mixkv.BlockFormat(P.FP16, 1, 128, 32).k_code_byte(0, 0)


def test_token_layout_windows():
    lay = layout(("text", 10), ("visual", 100), ("text", 6))
    assert lay.num_tokens == 116
    assert lay.num_windows(32) == 3
    assert lay.window_starts(32) == [10, 42, 74]
    assert lay.segments[1] == mixkv.Segment(mixkv.TokenKind.Visual, 100)
    assert lay == layout(("text", 10), ("visual", 100), ("text", 6))
    assert "TokenKind.Visual, 100" in repr(lay)


def test_token_layout_rejects_bad_segments():
    with pytest.raises(ValueError, match="segments"):
        mixkv.TokenLayout([])
    with pytest.raises(ValueError, match=r"segments\[1\]\.length"):
        layout(("text", 3), ("visual", 0))


def test_precision_plan_accessors():
    plan = plan_of([[P.FP16, P.INT4, P.INT2], [P.INT2, P.INT2, P.FP16]])
    assert (plan.num_layers, plan.num_windows) == (2, 3)
    assert plan.at(0, 1) == P.INT4
    assert plan.window_counts(1) == [1, 0, 2]
    plan.set_score(2, 0.25)
    assert plan.score(2) == 0.25
    assert plan == plan and plan != mixkv.PrecisionPlan(2, 3)
    with pytest.raises(IndexError, match="layer"):
        plan.at(2, 0)
    with pytest.raises(IndexError, match="window"):
        plan.set(0, 3, P.FP16)
    with pytest.raises(ValueError, match="num_layers"):
        mixkv.PrecisionPlan(0, 1)
