"""Disaggregated inference (DI): a prefill engine's KV cache moved into a GK decode build's cache.

- ``plan``: the transfer plan, a pure function of a build's ``layout/kv.json`` (and the prefill's
  tensor-parallel degree): the prefill engine's registered regions, and for every decode rank,
  layer and K/V half which prefill rank, region, byte offset and length it reads; the SWA N-1
  rule; the conversion packed FP8 K needs.
- ``nixl``: NIXL agents (UCX) and READ transfers with a deadline.
- ``wire``: the out-of-band handshake (agent metadata, regions, block ids) as bounded JSON frames.
- ``prefill``: a prefill engine process: the streamed reference over the prompts, K/V written in
  seed 000's per-buffer layout in the build's KV format, regions registered with NIXL.
- ``decode``: the decode side: handshake, descriptors from the plan, READ, conversion; what
  ``gkbuild verify --prefill nixl`` runs before its first decode step.
"""
