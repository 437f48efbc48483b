import json

import torch

if not hasattr(torch, "float8_e4m3"):
    torch.float8_e4m3 = torch.float8_e4m3fn  # see ../README.md


class _XLAC:
    @staticmethod
    def _get_xla_tensors_hlo_proto(tensors):
        return json.dumps([[list(t.shape), str(t.dtype)] for t in tensors]).encode()
