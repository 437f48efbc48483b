import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gkbuild.checkpoint import mxfp4
from gkbuild.errors import GkError


def _blocks_scales(draw_shape):
    return st.tuples(
        hnp.arrays(np.uint8, draw_shape + (16,)),
        hnp.arrays(np.uint8, draw_shape, elements=st.integers(0, 250)),
    )


def test_nibble_order_and_lut():
    # byte 0x21: element 0 = low nibble 1 (0.5), element 1 = high nibble 2 (1.0)
    blocks = np.zeros((1, 16), np.uint8)
    blocks[0, 0] = 0x21
    blocks[0, 15] = 0xF7  # element 30 = 7 (6.0), element 31 = 15 (-6.0)
    v = mxfp4.decode(blocks, np.array([128], np.uint8))  # scale 2^1
    assert v[0] == 1.0 and v[1] == 2.0
    assert v[30] == 12.0 and v[31] == -12.0
    assert np.all(v[2:30] == 0)


def test_scale_255_is_nan_and_rejected():
    v = mxfp4.decode(np.zeros((2, 16), np.uint8), np.array([127, 255], np.uint8))
    assert np.all(v[:32] == 0) and np.all(np.isnan(v[32:]))
    with pytest.raises(GkError, match="255"):
        mxfp4.check_scales(np.array([1, 255], np.uint8), "f: t")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3).flatmap(lambda r: _blocks_scales((r, 3))))
def test_encode_decode_roundtrip_on_representable_values(bs):
    blocks, scales = bs
    v = mxfp4.decode(blocks, scales)
    b2, s2 = mxfp4.encode(v)
    v2 = mxfp4.decode(b2, s2)
    assert np.array_equal(v.view(np.uint32), v2.view(np.uint32))  # bit for bit, signed zeros too


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, (2, 64), elements=st.floats(-1e4, 1e4, width=32)))
def test_encode_rounds_to_nearest_grid_value(x):
    blocks, scales = mxfp4.encode(x)
    y = mxfp4.decode(blocks, scales)
    xb, yb = x.reshape(-1, 32), y.reshape(-1, 32)
    for i in range(xb.shape[0]):
        e = int(scales.reshape(-1)[i]) - 127
        grid = np.ldexp(mxfp4.E2M1, e)
        assert np.abs(xb[i]).max() <= 6.0 * 2.0 ** e  # the scale fits the block max
        best = np.abs(xb[i][:, None] - grid[None, :]).min(axis=1)
        assert np.all(np.abs(xb[i] - yb[i]) <= best)  # nearest (ties either way)


def test_pack_unpack_inverse():
    codes = np.random.default_rng(0).integers(0, 16, (4, 96), dtype=np.uint8)
    assert np.array_equal(mxfp4.unpack_codes(mxfp4.pack_codes(codes)), codes)
