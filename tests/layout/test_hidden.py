import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gkbuild.layout import hidden


def test_sigma_is_the_contract_formula_and_pad_lanes_interleave():
    Hp, H = 3072, 2880
    s = hidden.sigma(Hp)
    for x in (0, 1, 767, 768, 769, 1535, 3071):
        assert s[x] == 4 * (x % 768) + x // 768
    pad = hidden.pad_lanes(H, Hp)
    assert pad.sum() == 192
    assert all(pad[g * 768:(g + 1) * 768].sum() == 48 for g in range(4))  # 48 zero lanes per group
    assert np.array_equal(np.flatnonzero(pad) % 768 >= 720, np.ones(192, bool))  # at each group's end


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12).map(lambda k: 32 * k), st.integers(1, 3), st.integers(0, 1), st.integers(0, 2**31))
def test_roundtrip_bit_for_bit_and_pad_lanes_zero(H, rows, axis, seed):
    Hp = -(-H // 512) * 512
    rng = np.random.default_rng(seed)
    shape = [rows, rows + 1]
    shape.insert(axis, H)
    x = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    k = hidden.to_kernel(x, axis, Hp)
    assert k.shape[axis] == Hp
    lanes = np.moveaxis(k, axis, 0)
    assert not np.any(lanes[hidden.pad_lanes(H, Hp)].view(np.uint16))
    # kernel lane x holds HF index sigma(x), written out independently
    hf = np.moveaxis(x, axis, 0)
    for xl in range(Hp):
        src = 4 * (xl % (Hp // 4)) + xl // (Hp // 4)
        if src < H:
            assert np.array_equal(lanes[xl].view(np.uint16), hf[src].view(np.uint16))
    back = hidden.from_kernel(k, axis, H)
    assert np.array_equal(back.view(np.uint16), x.view(np.uint16))


def test_strict_inverse_rejects_nonzero_padding():
    import pytest

    k = hidden.to_kernel(np.ones((2, 96), np.float32), 1, 512)
    k[0, hidden.pad_lanes(96, 512)] = 1.0
    with pytest.raises(ValueError, match="padding"):
        hidden.from_kernel(k, 1, 96)
