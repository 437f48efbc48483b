"""mxpairs.take, the compiled lookup both decodes share. Its values are checked against independent
decodes elsewhere (tests/test_reference.py: transformers' own; tests/kernels/test_twins.py: the
traced readers on every byte at every scale); here, what it accepts and where it writes."""

import numpy as np
import pytest

from gkbuild import mxpairs

PAIRS = np.arange(1 << 17, dtype=np.float32).reshape(1 << 16, 2)  # row r holds 2r, 2r + 1: the index shows


def test_each_byte_looks_up_its_scales_row():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 16), dtype=np.uint8)
    scales = rng.integers(0, 256, (3, 5), dtype=np.uint8)
    got = mxpairs.take(PAIRS, blocks, scales)
    rows = scales.astype(np.int64)[..., None] << 8 | blocks
    assert got.shape == (3, 5, 32)
    assert np.array_equal(got[..., 0::2], 2 * rows) and np.array_equal(got[..., 1::2], 2 * rows + 1)
    into = np.full(3 * 5 * 32, np.nan, np.float32)
    assert np.shares_memory(mxpairs.take(PAIRS, blocks, scales, into), into)
    assert np.array_equal(into.reshape(got.shape), got)
    # a strided view (a tile read across its rows) is looked up as the copy it stands for
    assert np.array_equal(mxpairs.take(PAIRS, blocks.transpose(1, 0, 2), scales.T), got.transpose(1, 0, 2))


@pytest.mark.parametrize("bad", ["pairs", "blocks_dtype", "blocks_shape", "scales_dtype", "out_size", "out_dtype",
                                 "out_strided"])
def test_refuses_what_would_read_or_write_out_of_bounds(bad):
    """The compiled loop checks no index: every argument that could take it off an array is refused first."""
    blocks, scales = np.zeros((4, 16), np.uint8), np.zeros(4, np.uint8)
    pairs, out = PAIRS, None
    if bad == "pairs":
        pairs = PAIRS[:256]
    elif bad == "blocks_dtype":
        blocks = blocks.astype(np.uint16)
    elif bad == "blocks_shape":
        blocks = np.zeros((4, 8), np.uint8)
    elif bad == "scales_dtype":
        scales = scales.astype(np.int64)
    elif bad == "out_size":
        out = np.empty(4 * 32 - 1, np.float32)
    elif bad == "out_dtype":
        out = np.empty(4 * 32, np.float64)
    else:
        out = np.empty(4 * 64, np.float32)[::2]
    with pytest.raises(ValueError):
        mxpairs.take(pairs, blocks, scales, out)
