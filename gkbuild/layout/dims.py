"""The padded and per-rank sizes every layout function and the planner agree on."""

from __future__ import annotations

from dataclasses import dataclass

MX_TILE = 512  # MX tiles are 512 wide on both the hidden and the intermediate axis
P_MAX = 128  # partitions


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Dims:
    H: int  # hidden (real)
    Hp: int  # hidden padded to the MX tile
    I: int  # noqa: E741 - intermediate (real)
    Ip: int  # intermediate padded
    P_I: int  # partitions of the intermediate tiles: min(128, Ip/4)
    E: int  # experts
    E_L: int  # experts a rank holds
    q: int  # q heads
    kv: int  # kv heads
    d: int  # head dim
    tp: int
    q_l: int  # q heads a TP rank holds
    kv_l: int  # kv heads a TP rank holds (1 when kv heads are replicated)
    V: int
    vtp: int
    V_s: int  # vocab a tail rank holds
    L: int

    @classmethod
    def of(cls, cfg, tp: int = 1, ep: int = 1, vtp: int = 1) -> "Dims":
        Ip = pad_to(cfg.I, MX_TILE)
        return cls(H=cfg.H, Hp=pad_to(cfg.H, MX_TILE), I=cfg.I, Ip=Ip, P_I=min(P_MAX, Ip // 4), E=cfg.E,
                   E_L=cfg.E // ep, q=cfg.q_heads, kv=cfg.kv_heads, d=cfg.d, tp=tp, q_l=cfg.q_heads // tp,
                   kv_l=max(1, cfg.kv_heads // tp), V=cfg.V, vtp=vtp, V_s=cfg.V // vtp, L=cfg.L)

    def kv_heads_of(self, tp_rank: int) -> list[int]:
        """The kv heads TP rank ``tp_rank`` holds (replicated when tp exceeds the kv heads)."""
        if self.kv >= self.tp:
            return list(range(tp_rank * self.kv_l, (tp_rank + 1) * self.kv_l))
        return [tp_rank * self.kv // self.tp]

    def q_heads_of(self, tp_rank: int) -> list[int]:
        return list(range(tp_rank * self.q_l, (tp_rank + 1) * self.q_l))
