"""Short whole prompts as static decode rows (EngineConfig.prompt_rows).

A whole-prompt step (prompt_step.py) runs rounds 1..R of fresh prompts. The fused prefill
(fused_prefill.py) runs them as GEMMs and FlashAttention-2 with about ten kernels a layer; even
replayed as a CUDA graph (prefill_graphs.py), its step of one short prompt of the embedded model
took longer on the device than a tree program of four chained iterations (idle timeline,
docs/benchmarks/2026-12-05-s27-h100.md: the "rounds" marks). At c = 1 that step is paid once per
request by every decoding path.

Prompt position p at round r is also a decode row: one token at position p and plane r - 1 that
attends over positions 0..p of its own sequence. So a step of at most `prompt_rows` prompt
tokens in all runs them as the rows of the static decoder's whole-token graph
(StaticDecoder.launch_token: rounds 1..R in one replay per row bucket), the path decode tokens
take: the Triton GEMVs up to gemv_rows rows, PDL, the paged decode attention. Each layer writes
every row's K/V before its attention reads the plane, so a row sees the rows before it, and the
context length position + 1 hides the ones after it: causal attention, as in the prefill.

The same math as the fused prefill and round steps, in another summation order (GEMV against
GEMM, paged against flash attention); the K/V of every plane lands in the prompt's slots as
theirs does. Rows of one prompt are staged without shared-prefix groups: they share its first
block, but one row's context is a single position.
"""
from __future__ import annotations

import numpy as np
import torch

from rltlab.common.device import tensor_to_device
from rltlab.engine.fused_prefill import prompt_slots

# The prompt tokens of the largest whole-prompt step that runs as decode rows, where the engine
# picks (EngineConfig.prompt_rows None): the GEMV path's own bound (kernels.MAX_GEMV_ROWS).
DEFAULT_PROMPT_ROWS = 64


def resolve_prompt_rows(rows: int | None, device: torch.device, cuda_graphs: bool) -> int:
    """EngineConfig.prompt_rows -> the bound, 0 = off. None: DEFAULT_PROMPT_ROWS where CUDA
    graphs run (a CUDA device with cuda_graphs), off elsewhere (the step is host-bound only
    where a graph replaces its launches)."""
    if rows is not None:
        return rows
    return DEFAULT_PROMPT_ROWS if cuda_graphs and device.type == "cuda" else 0


def run_prompt_rows(runner, seqs, lengths: list[int], rounds: int) -> torch.Tensor:
    """Rounds 1..rounds of fresh whole prompts (seqs, their prompts' lengths) as decode rows
    of runner's static decoder, grown to runner.prompt_rows rows at first use -> h_rounds of
    each prompt's last position [B, H], as ModelRunner.run_prompts returns it."""
    total, block_size = sum(lengths), runner.block_size
    static = runner.static_rows(max(total, runner.prompt_rows))
    host = np.empty((3, total), dtype=np.int64)   # token ids, positions, slots
    tables, lo = [], 0
    for seq, n in zip(seqs, lengths):
        host[0, lo: lo + n] = seq.token_ids(0, n)
        host[1, lo: lo + n] = np.arange(n)
        host[2, lo: lo + n] = prompt_slots(seq, n, block_size)
        tables += [seq.block_table] * n
        lo += n
    static.stage(host[1].tolist(), [0] * total, host[2].tolist(), tables, groups=False)
    ids = tensor_to_device(torch.from_numpy(host[0]), runner.device)
    static.launch_token(total, rounds, runner.model.model.embed_tokens(ids))
    if len(seqs) == 1:
        return static.hidden_out[total - 1: total].clone()
    ends = tensor_to_device(torch.tensor(np.cumsum(lengths) - 1), runner.device)
    return static.hidden_out.index_select(0, ends)
