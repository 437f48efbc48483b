"""Stand-in for baonudesifeizhai/nki-library@9f2490f6's ``gpt_oss_tail_chunked_megakernel``
(src/nkilib_src/nkilib/experimental/gpt_oss_tail/tail_chunked_megakernel.py): its published
parameter list (from gkbuild's committed interface), the entry assertions of its source
(T:984-1072), the batch-group eligibility of its chunked top-k (an independent reading of
``pick_chunks`` / ``interleaved_fold_supported``), and its outputs in order (T:1195-1222).

``hop_meshes`` is a tuple of meshes, each a tuple of rank tuples: the kernel reads ``len(mesh[0])``
(T:1018-1019) and builds ``ncc.ReplicaGroup(groups)`` for each hop itself (T:831, T:1161), so an
opaque ReplicaGroup handed in fails at ``mesh[0]``.
"""

import torch
from nki.collectives import ReplicaGroup

from _checks import dtype_name, kernel_assert
from standin import kernel

REVISION = "baonudesifeizhai/nki-library@9f2490f68c3ff0c222458095e169b83778fe59e5"
_PMAX, _PARTS, _ROWS_PER_TILE, _N_MAX = 128, 16, 8, 65536


def _padded(n):
    return _PARTS * ((n + _PARTS - 1) // _PARTS)


def _chunks(bxs, vocab, k):
    if _padded(vocab) < _N_MAX:
        return 1
    best = None
    for p in (1, 2, 4, 8, 16, 32, 64, 128):
        if vocab % p:
            continue
        w = vocab // p
        if w < 8 or _padded(w) >= _N_MAX or k > w or (p > 1 and not 8 <= p * k <= _PMAX * _PMAX):
            continue
        key = ((bxs * p) % _ROWS_PER_TILE != 0, w % _PARTS != 0, p)
        best = key if best is None or key < best else best
    return best[2]


def _fold_supported(bxs, vocab, k, peer_width):
    if peer_width <= 0:
        return False
    p = _chunks(bxs, vocab, k)
    if p == 1:
        return False
    w = vocab // p
    if not (k % _PARTS == 0 and (bxs * p) % _ROWS_PER_TILE == 0 and w % _PARTS == 0):
        return False
    cols = (w + _PARTS - 1) // _PARTS
    return vocab % peer_width == 0 and cols % peer_width == 0 and w % peer_width == 0


def _body(hidden_states, gamma, lm_head_weight_t, eps, hidden_actual, zero_interleaved_pad, k, sampling_params,
          replica_groups, hop_meshes, dummy_collectives, emit_logits, debug_taps, deferred_rms, skip_nan_fold,
          a2a_batch_groups):
    kernel_assert(hidden_states.ndim == 2, "hidden_states (slab) must be [rows, H]")
    kernel_assert(dtype_name(hidden_states) in ("float32", "float16", "bfloat16"),
                  f"hidden_states must be fp32/fp16/bf16, got {hidden_states.dtype}")
    kernel_assert(lm_head_weight_t.ndim == 2, "lm_head_weight_t must be [H, V_s]")
    kernel_assert(dtype_name(lm_head_weight_t) == "bfloat16", f"lm_head_weight_t must be bfloat16, got "
                                                               f"{lm_head_weight_t.dtype}")
    kernel_assert((replica_groups is None) != (hop_meshes is None), "supply exactly one of replica_groups or hop_meshes")
    hops = (replica_groups,) if hop_meshes is None else tuple(hop_meshes)
    kernel_assert(len(hops) >= 1, "at least one hop is required")
    gbs, hidden = hidden_states.shape
    w_hidden, v_s = lm_head_weight_t.shape
    kernel_assert(w_hidden == hidden, f"weight hidden {w_hidden} must match hidden_states hidden {hidden}")
    vtp = 1
    for mesh in hops:
        vtp *= len(mesh[0])
    for mesh in hops:
        ReplicaGroup(mesh)
    kernel_assert(gbs % vtp == 0, f"gbs ({gbs}) must be divisible by VTP ({vtp})")
    rows = gbs // vtp
    vocab = vtp * v_s
    h_actual = hidden if hidden_actual is None else hidden_actual
    kernel_assert(0 < h_actual <= hidden, f"hidden_actual ({h_actual}) must be in (0, {hidden}]")
    if h_actual < hidden and zero_interleaved_pad:
        kernel_assert(hidden % 4 == 0 and h_actual % 4 == 0, "mxfp4 padding needs H and H_u divisible by 4")
    kernel_assert(tuple(gamma.shape) == (1, hidden) and dtype_name(gamma) == "float32", "gamma must be [1, H] fp32")
    if sampling_params is not None:
        kernel_assert(sampling_params.ndim == 2, "sampling_params must be [gbs/VTP, 3]")
        kernel_assert(sampling_params.shape[0] == rows, f"sampling_params must hold THIS RANK'S {rows} rows, got "
                                                        f"{sampling_params.shape[0]}")
        kernel_assert(sampling_params.shape[1] in (3, 4), "sampling_params needs 3 or 4 columns")
    g = a2a_batch_groups
    kernel_assert(g >= 1 and gbs % g == 0, f"a2a_batch_groups ({g}) must divide gbs ({gbs})")
    if g > 1:
        kernel_assert(len(hops) == 1, "a2a_batch_groups > 1 is defined for the single-hop exchange only")
        kernel_assert((gbs // g) % _PMAX == 0, f"each batch group ({gbs // g} rows) must be whole lm_head tiles")
        kernel_assert(rows % g == 0, f"a2a_batch_groups ({g}) must divide rows_per_rank ({rows})")
        kernel_assert(_fold_supported(rows, vocab, k, v_s), "a2a_batch_groups > 1 requires the receive-layout fold")
    values = torch.zeros((rows, k), dtype=torch.bfloat16)
    indices = torch.zeros((rows, k), dtype=torch.uint32)
    base = (values, indices)
    if sampling_params is not None:
        base = base + (torch.zeros((rows, 1), dtype=torch.uint32),)
    if emit_logits:
        base = (torch.zeros((gbs, v_s), dtype=torch.float32),) + base
    return base


gpt_oss_tail_chunked_megakernel = kernel(REVISION, "gpt_oss_tail_chunked_megakernel", _body)
