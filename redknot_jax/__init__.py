"""RedKnot-JAX: DeepSeek-V4 in JAX/Flax NNX with offline-online document reuse (RedKnot-MLA).

Shape legend, used in every einsum and in `# [b, t, h, k]` comments:

    b batch            t query rows (tokens of the chunk)    s key rows
    d hidden size      h query heads                         k head dim (512)
    r rope dims (64)   g output groups                       o o_lora_rank (per group)
    q q_lora_rank      e routed experts                      f expert width
    n mHC streams      w compressed entries                  i indexer heads, j indexer head dim
    c compressor slots per window (m, or 2m for CSA)

Modules follow `shared/reference/deepseek_v4.md`: `config` (ModelConfig), `rope`, `norms`,
`mhc`, `compressor`, `indexer`, `attention`, `moe`, `model` (blocks, cache, forward),
`weights` (the one key map), `generate` (prefill / decode / sampling).
"""

__version__ = "0.1.0"
