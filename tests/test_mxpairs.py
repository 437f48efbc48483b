"""mxpairs.take, the compiled lookup both decodes share. Its values are checked against independent
decodes elsewhere (tests/test_reference.py: transformers' own; tests/kernels/test_twins.py: the
traced readers on every byte at every scale); here, what it accepts and where it writes."""

import numpy as np
import pytest

from gkbuild import mxpairs

PAIRS = np.arange(1 << 17, dtype=np.float32).reshape(1 << 16, 2)  # row r holds 2r, 2r + 1: the index shows


def test_each_byte_looks_up_its_scales_row():
    """Byte m of a block is byte m % 2 (low first) of its word m // 2, whatever the host's byte order."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 1 << 16, (3, 5, 8), dtype=np.uint16)
    scales = rng.integers(0, 256, (3, 5), dtype=np.uint8)
    got = mxpairs.take(PAIRS, words, scales)
    w = words.astype(np.int64)
    rows = scales.astype(np.int64)[..., None] << 8 | np.stack([w & 0xFF, w >> 8], -1).reshape(3, 5, 16)
    assert got.shape == (3, 5, 32)
    assert np.array_equal(got[..., 0::2], 2 * rows) and np.array_equal(got[..., 1::2], 2 * rows + 1)
    into = np.full(3 * 5 * 32, np.nan, np.float32)
    assert np.shares_memory(mxpairs.take(PAIRS, words, scales, into), into)
    assert np.array_equal(into.reshape(got.shape), got)


@pytest.mark.parametrize("lead", [(), (7,), (2, 3), (2, 3, 4, 5), (2, 1, 3, 2, 2, 3)])
def test_strided_words_are_looked_up_where_they_lie(lead):
    """A tile read across its rows (the twins' transposed view) gives what its copy gives, for any
    number of leading axes."""
    rng = np.random.default_rng(len(lead))
    words = rng.integers(0, 1 << 16, (8, *lead, 9), dtype=np.uint16)
    scales = rng.integers(0, 256, (*lead, 9), dtype=np.uint8)
    view = np.moveaxis(words, 0, -1)  # [..., 9, 8], the 8 words of a block far apart
    assert not view.flags.c_contiguous
    strided_scales = np.moveaxis(np.ascontiguousarray(np.moveaxis(scales, -1, 0)), 0, -1)
    assert not strided_scales.flags.c_contiguous or not lead
    got = mxpairs.take(PAIRS, view, strided_scales)
    assert np.array_equal(got, mxpairs.take(PAIRS, np.ascontiguousarray(view), np.ascontiguousarray(scales)))


@pytest.mark.parametrize("bad", ["pairs", "words_dtype", "words_shape", "scales_dtype", "out_size", "out_dtype",
                                 "out_strided"])
def test_refuses_what_would_read_or_write_out_of_bounds(bad):
    """The compiled loop checks no index: every argument that could take it off an array is refused first."""
    words, scales = np.zeros((4, 8), np.uint16), np.zeros(4, np.uint8)
    pairs, out = PAIRS, None
    if bad == "pairs":
        pairs = PAIRS[:256]
    elif bad == "words_dtype":
        words = np.zeros((4, 16), np.uint8)
    elif bad == "words_shape":
        words = np.zeros((4, 4), np.uint16)
    elif bad == "scales_dtype":
        scales = scales.astype(np.int64)
    elif bad == "out_size":
        out = np.empty(4 * 32 - 1, np.float32)
    elif bad == "out_dtype":
        out = np.empty(4 * 32, np.float64)
    else:
        out = np.empty(4 * 64, np.float32)[::2]
    with pytest.raises(ValueError):
        mxpairs.take(pairs, words, scales, out)
