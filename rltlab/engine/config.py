"""EngineConfig: the rollout engine's knobs, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rltlab import kernels
from rltlab.model.architecture import EXIT_SEMANTICS, SELECT_ONLY

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
DECODE_PATHS = ("auto", "static", "gather")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise ValueError(f"EngineConfig.dtype must be one of {sorted(_DTYPES)}, got {value!r}")
    return _DTYPES[value]


@dataclass
class EngineConfig:
    """Limits of one engine.

    max_num_seqs: sequences holding KV blocks at once (one row each per step).
    max_num_batched_tokens: query tokens per step (one step = one round for every row).
    prefill_chunk: most prompt tokens one sequence puts in one chunk.
    num_blocks: KV blocks in the pool; None sizes it from kv_cache_memory_gib, capped at
    what max_num_seqs sequences of max_model_len tokens can use.
    max_model_len: prompt + output tokens of one sequence; None = min(model limit, 4096).
    exit_policy / exit_policy_args: the default exit policy (a registered name) and the keyword
    arguments of its factory; a request may name another policy in its SamplingParams.
    exit_semantics: "last_exited" (a token stops at its exit round; deeper planes get its
    exit-round K/V) or "select_only" (every token runs all R rounds with full-depth K/V; the
    q_exit / fixed rule only selects the round its output comes from, as the Hugging Face Ouro
    code does; rltlab.engine.select_only).
    default_min_loops: min_loops of requests that set none; None = 2 under last_exited
    (vllm-rlt), 1 under select_only (the Hugging Face code has no min_loops).
    decode_path: "static" runs decode rows through fixed buffers with Triton paged attention
    (rltlab.engine.static_decode), "gather" through the plain torch path, "auto" = static on
    CUDA, gather elsewhere. cuda_graphs: capture the static path's round per batch bucket (CUDA
    only; False = the engine's eager mode). compile: torch.compile the static path's per-layer
    functions (fuses norms, RoPE and SwiGLU; costs a one-off compile). small_batch_kernels: on
    CUDA, static rounds of up to gemv_rows rows run every matmul as a weight-streaming Triton
    GEMV with SiLU * up and RoPE + K/V write fused (rltlab.kernels.small_batch); False = cuBLAS.
    gemv_rows: with small_batch_kernels, static rounds of at most this many rows (1..64) take
    the Triton GEMV path (and PDL, the fused q/k/v + RoPE, the L2 prefetch); more rows take
    cuBLAS. 1 = one-row rounds only, the measured best in bf16 at the Ouro-1.4B shape
    (rltlab.engine.static_decode.GEMV_ROWS); fp32 rows of 2..64 run as FMA products.
    pdl: on Hopper or newer GPUs, one-row static rounds launch their Triton kernels with
    programmatic dependent launch, so each kernel starts while the one before drains
    (rltlab.kernels.pdl); ignored where unavailable (CPU, older GPUs, the interpreter).
    fused_qkv_rope: one-row Triton rounds compute q/k/v, RoPE and the K/V write in one kernel
    (rltlab.kernels.rope_kv_linear); False = the q/k/v GEMV, then rope_write_kv.
    l2_prefetch_mb: one-row PDL rounds (with fused_qkv_rope): each kernel brings up to this many
    MiB of the next GEMV's weight into L2 (rltlab.kernels.l2_prefetch); 0 = off. 4 was the best
    of 1-16 on the H200 (docs/benchmarks/2026-12-02-s5-h200.md).
    fused_tokens: with the static path, run all rounds of host-fixed-depth decode tokens in one
    launch when nothing needs to look between rounds (rltlab.engine.token_step).
    round_window: with whole-token steps on, decode rows at mixed host-fixed depths
    run up to this many round steps per host round trip (rltlab.engine.round_window); 0 = off
    (whole tokens deepest first, token_step.py). round_window_admit: while windows run,
    waiting requests are admitted (all that fit, at a window boundary) once this many of
    max_num_seqs are free (round_window.py).
    prefill_first: with round windows on, while any row prefills or a waiting request can be
    admitted, every step is a prefill step with every decode row held (as vLLM v0 schedules):
    an admitted prompt runs its rounds back to back and the windows between run every decode
    row (round_window.py). False: each decode row also runs one round in every prefill step,
    one host round trip per round.
    token_window: with whole-token steps on, rows that all decode at one host-fixed depth run
    up to this many tokens per host round trip (rltlab.engine.token_window); 0 or 1 = one
    token per step.
    window_chain: at most this many token or round windows per engine step, each launched
    before the one ahead of it is read back, while nothing between them needs the host: the
    same rows go on (none reaches its length limit or stops), and none streams its output
    (window_io.py); 1 = one window per step, read back before the next is planned.
    fused_prefill: with the static path, run prefill chunks (rows of contiguous positions)
    through the static path's fused layer with causal paged attention
    (rltlab.engine.fused_prefill); False = the plain-torch gather path.
    cudnn_prefill_after: in the fused prefill, whole prompts of one (chunks, length) shape take
    cuDNN attention once that shape has run this many rounds, FlashAttention-2 before
    (fused_prefill.py says why); None = FlashAttention-2 always.
    pad_prefill_attention: in the fused prefill's eager steps, whole prompts of different lengths
    within one length bucket share one causal attention launch per layer, each padded at its
    end to the bucket's longest, instead of one launch per distinct length (prompts of many
    lengths, as real RL prompts are, make many launches: fused_prefill.py); False (the
    default until measured on a GPU) = one launch per length.
    shared_prefix_attention: in the static path's Triton decode attention, rows whose block
    tables share their leading blocks (the samples of an n > 1 request: groups.py) read that
    shared prompt's K/V once per group, not once per row (kernels/shared_prefix.py; same
    attention, another summation order); the token and per-step paths, not round windows.
    prefill_graph_tokens: with the fused prefill, steps of whole prompts that pad to at most
    this many tokens (prompts and length rounded up to buckets) replay a CUDA graph per
    padded shape from its second step on (rltlab.engine.prefill_graphs: such steps are
    host-bound); None (the default) = 4096 where CUDA graphs run (a CUDA device and
    cuda_graphs), off elsewhere; 0 = off.
    fused_spec: with the static path and a DraftProposer, run each speculative iteration
    (K chained drafts, verification, acceptance / rejection sampling) as one device program,
    one CUDA graph on a GPU (rltlab.engine.spec_graph); False = the host-driven loop (one
    read-back per draft). spec_chain: with fused_spec, up to this many iterations run back to
    back in one program, the next one's tokens, positions and slots taken from the last one's
    acceptance on the device, and are read back once (spec_graph.py); 1 (the default) = one
    iteration per host turn (chains of 4 measured 0.95-1.03x of that on the H200). Requests
    asking for log-probs or streaming take one at a time.
    spec_pipeline: with a TreeProposer, up to this many programs (of spec_chain iterations)
    per engine step, each launched from the last one's acceptance on the device as soon as
    the host has read that one back and seen that the sequence goes on, so that the host's
    handling of one program's tokens overlaps the next one's GPU time (tree_graph.py; 1.02-1.05x
    end to end over 1 at c = 1 on the H200, docs/benchmarks/2026-12-04-s19-h200.md); 1 = one
    program per step. Streamed requests take one at a time.
    launch_behind_prompt: a lone request's first decode launch after its whole-prompt step
    (its first tree program with a TreeProposer, else its first token window) is queued
    right behind that step, from token 0 still on the device, before token 0 is read back,
    so that the host's turn between the two (the read-back, token 0's bookkeeping, the
    engine's next step, the staging) overlaps the launch instead of idling the device; plain
    greedy requests only (prompt_step.py; the same tokens and statistics; at c = 1 over four
    machine starts 1.01-1.05x paired on the tree path, 1.00-1.04x for target only:
    docs/benchmarks/2026-12-05-s26-h200.md; off by default).
    device_loop: with a TreeProposer on CUDA graphs (spec_chain 1), a request's programs
    after its first are launched by the device itself, one CUDA graph looping over them
    (conditional nodes; rltlab.engine.device_loop), not by the host after each read-back; the
    same tokens and statistics. Experimental and off by default: it needs nvcc (built once)
    and CUDA >= 12.8, and falls back to the host loop with a warning; on two H100 starts it
    was slower than the host loop (0.983 paired: docs/benchmarks/2026-12-06-s30-h100.md).
    whole_prompt_steps: a step whose rows are all fresh whole prompts, with no other sequence
    running (c = 1, the start of a batch), runs their R rounds and samples their first tokens
    in one engine step (rltlab.engine.prompt_step; the same tokens, log-probs and K/V), not in
    R round steps; not with round observers or select_only. False = R round steps always.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 512
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gib: float = 2.0
    max_model_len: int | None = None
    dtype: torch.dtype | str | None = None
    device: torch.device | str | None = None
    logprobs_mode: str = "raw_logprobs"
    exit_policy: str = "q_exit"
    exit_policy_args: dict[str, Any] = field(default_factory=dict)
    exit_semantics: str = "last_exited"
    default_min_loops: int | None = None
    decode_path: str = "auto"
    cuda_graphs: bool = True
    compile: bool = False
    small_batch_kernels: bool = True
    gemv_rows: int = 1
    pdl: bool = True
    fused_qkv_rope: bool = True
    l2_prefetch_mb: float = 4.0
    fused_tokens: bool = True
    round_window: int = 16
    round_window_admit: int = 1
    prefill_first: bool = True
    token_window: int = 8
    window_chain: int = 8
    fused_prefill: bool = True
    cudnn_prefill_after: int | None = 16
    pad_prefill_attention: bool = False
    shared_prefix_attention: bool = True
    prefill_graph_tokens: int | None = None
    fused_spec: bool = True
    spec_chain: int = 1
    spec_pipeline: int = 16
    launch_behind_prompt: bool = False
    device_loop: bool = False
    whole_prompt_steps: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk", "block_size",
                     "round_window_admit", "window_chain", "spec_chain", "spec_pipeline"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.prefill_graph_tokens is not None and (
                not isinstance(self.prefill_graph_tokens, int)
                or isinstance(self.prefill_graph_tokens, bool) or self.prefill_graph_tokens < 0):
            raise ValueError("EngineConfig.prefill_graph_tokens must be None or an int >= 0, got "
                             f"{self.prefill_graph_tokens!r}")
        for name in ("num_blocks", "max_model_len", "default_min_loops", "cudnn_prefill_after"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):
                raise ValueError(f"EngineConfig.{name} must be a positive int or None, "
                                 f"got {value!r}")
        for name in ("round_window", "token_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"EngineConfig.{name} must be an int >= 0 (0 = off), "
                                 f"got {value!r}")
        if isinstance(self.l2_prefetch_mb, bool) or not isinstance(
                self.l2_prefetch_mb, (int, float)) or not 0 <= self.l2_prefetch_mb < 1024:
            raise ValueError("EngineConfig.l2_prefetch_mb must be a number of MiB in [0, 1024), "
                             f"got {self.l2_prefetch_mb!r}")
        if not self.kv_cache_memory_gib > 0:
            raise ValueError("EngineConfig.kv_cache_memory_gib must be positive, got "
                             f"{self.kv_cache_memory_gib!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"EngineConfig.logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        if not isinstance(self.exit_policy, str) or not self.exit_policy:
            raise ValueError(f"EngineConfig.exit_policy must be a policy name, "
                             f"got {self.exit_policy!r}")
        if not isinstance(self.exit_policy_args, dict) or \
                not all(isinstance(key, str) for key in self.exit_policy_args):
            raise ValueError("EngineConfig.exit_policy_args must be a dict with str keys "
                             f"(keyword arguments of the policy's factory), got "
                             f"{self.exit_policy_args!r}")
        if self.exit_semantics not in EXIT_SEMANTICS:
            raise ValueError(f"EngineConfig.exit_semantics must be one of {EXIT_SEMANTICS}, "
                             f"got {self.exit_semantics!r}")
        if self.decode_path not in DECODE_PATHS:
            raise ValueError(f"EngineConfig.decode_path must be one of {DECODE_PATHS}, "
                             f"got {self.decode_path!r}")
        for name in ("cuda_graphs", "compile", "small_batch_kernels", "pdl", "fused_qkv_rope",
                     "fused_tokens", "fused_prefill", "fused_spec", "prefill_first",
                     "pad_prefill_attention", "shared_prefix_attention", "whole_prompt_steps",
                     "launch_behind_prompt", "device_loop"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.gemv_rows, bool) or not isinstance(self.gemv_rows, int) or \
                not 1 <= self.gemv_rows <= kernels.MAX_GEMV_ROWS:
            raise ValueError(f"EngineConfig.gemv_rows must be an int in "
                             f"1..{kernels.MAX_GEMV_ROWS}, got {self.gemv_rows!r}")
        self.dtype = parse_dtype(self.dtype)
        if self.device is not None:
            self.device = torch.device(self.device)

    def use_static_decode(self, device: torch.device) -> bool:
        return self.decode_path == "static" or (self.decode_path == "auto"
                                                and device.type == "cuda")

    def resolve_default_min_loops(self) -> int:
        if self.default_min_loops is not None:
            return self.default_min_loops
        return 1 if self.exit_semantics == SELECT_ONLY else 2

    def resolve_max_model_len(self, model_config) -> int:
        limit = model_config.max_position_embeddings
        value = self.max_model_len or min(limit, 4096)
        if value > limit:
            raise ValueError(f"EngineConfig.max_model_len={value} exceeds the model's "
                             f"max_position_embeddings={limit}")
        return value

    def resolve_num_blocks(self, cfg, max_model_len: int, elem_size: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        per_block = (cfg.num_hidden_layers * 2 * cfg.num_rounds * self.block_size
                     * cfg.num_key_value_heads * cfg.head_dim * elem_size)
        from_memory = int(self.kv_cache_memory_gib * 2 ** 30) // per_block
        useful = self.max_num_seqs * -(-max_model_len // self.block_size)
        return max(1, min(from_memory, useful))
