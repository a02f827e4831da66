"""The engine's configuration, validated on construction and split by concern:

- EngineConfig: what a user sets: limits (sequences, tokens, KV memory, lengths), the device
  and dtype, and semantics (exit policy, exit semantics, log-prob mode).
- ExecutionConfig: how the engine runs: performance switches whose defaults are the fastest
  measured setting (docs/results.md). Turning one off changes speed, never outputs.

`LLM(model, **kwargs)` takes the fields of both flat, as vLLM's LLM takes its engine args.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from rltlab import kernels
from rltlab.common.device import AUTO, default_dtype, resolve_device
from rltlab.model.architecture import EXIT_SEMANTICS, SELECT_ONLY

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
DECODE_PATHS = ("auto", "static", "gather")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
CPU_KV_CACHE_GIB = 2.0        # the KV pool off CUDA when kv_cache_memory_gib is None
ACTIVATION_RESERVE_GIB = 2.0  # kept free on a GPU for activations, graphs and the allocator
# Blocks beyond max_num_seqs full sequences, for a draft tree's private KV (two per leaf but
# the first: the shipped 12-leaf tree takes 22), so set_proposer fits a pool sized by default.
SPECULATION_RESERVE_BLOCKS = 32


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """None / "auto" -> None (decided with the device: resolve_dtype); a name or a floating
    torch.dtype -> that dtype; anything else a one-line ValueError."""
    if value is None or value == AUTO:
        return None
    if isinstance(value, torch.dtype):
        if value not in set(_DTYPES.values()):
            raise ValueError(f"EngineConfig.dtype must be a floating dtype "
                             f"({sorted(_DTYPES)} or 'auto'), got {value}")
        return value
    if value not in _DTYPES:
        raise ValueError(f"EngineConfig.dtype must be one of {sorted(_DTYPES)} or 'auto', "
                         f"got {value!r}")
    return _DTYPES[value]


def _positive_int(owner: str, name: str, value, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int{' or None' * allow_none}, "
                         f"got {value!r}")


@dataclass
class ExecutionConfig:
    """How the engine runs. Every switch keeps the outputs; the defaults are the fastest
    measured setting at the Ouro-1.4B shape (docs/results.md). Off CUDA most of them do
    nothing: the CPU runs the plain torch path.

    decode_path: "static" runs decode rows through fixed buffers with Triton paged attention
    (rltlab.engine.static_decode), "gather" through the plain torch path, "auto" = static on
    CUDA, gather elsewhere.
    cuda_graphs: capture the static path's round per batch bucket (CUDA only; False = eager).
    compile: torch.compile the static path's per-layer functions (a one-off compile).
    small_batch_kernels: on CUDA, static rounds of up to gemv_rows rows run every matmul as a
    weight-streaming Triton GEMV with SiLU * up and RoPE + K/V write fused
    (rltlab.kernels.small_batch); False = cuBLAS.
    gemv_rows: static rounds of at most this many rows (1..64) take the Triton GEMV path; more
    rows take cuBLAS. fp32 rows of 2..64 run as FMA products.
    pdl: on Hopper or newer, one-row static rounds launch their Triton kernels with
    programmatic dependent launch (rltlab.kernels.pdl); ignored where unavailable.
    fused_qkv_rope: one-row Triton rounds compute q/k/v, RoPE and the K/V write in one kernel
    (rltlab.kernels.rope_kv_linear).
    l2_prefetch_mb: one-row PDL rounds: each kernel brings up to this many MiB of the next
    GEMV's weight into L2 (rltlab.kernels.l2_prefetch); 0 = off.
    fused_tokens: run all rounds of host-fixed-depth decode tokens in one launch when nothing
    needs to look between rounds (rltlab.engine.token_step).
    round_window: decode rows at mixed host-fixed depths run up to this many round steps per
    host round trip (rltlab.engine.round_window); 0 = off.
    prefill_first: with round windows, while a row prefills or a request can be admitted,
    every step is a prefill step with the decode rows held (round_window.py).
    token_window: rows that all decode at one host-fixed depth run up to this many tokens per
    host round trip (rltlab.engine.token_window); 0 or 1 = one token per step.
    window_chain: at most this many token or round windows per engine step, each launched
    before the one ahead of it is read back (window_io.py).
    fused_prefill: prefill chunks through the static path's fused layer with causal paged
    attention (rltlab.engine.fused_prefill); False = the plain-torch gather path.
    cudnn_prefill_after: whole prompts of one (chunks, length) shape take cuDNN attention once
    that shape has run this many rounds, FlashAttention-2 before; None = FlashAttention-2.
    pad_prefill_attention: eager prefill steps pad the prompts of one length bucket into one
    attention launch per layer instead of one per distinct length.
    shared_prefix_attention: rows whose block tables share their leading blocks (the samples
    of an n > 1 request) read that shared prompt's K/V once per group (kernels/shared_prefix.py).
    prefill_graph_tokens: whole-prompt steps that pad to at most this many tokens replay a CUDA
    graph per padded shape (rltlab.engine.prefill_graphs); None = 4096 where CUDA graphs run,
    off elsewhere; 0 = off.
    fused_spec: with the static path, each DraftProposer iteration (drafts, verification,
    acceptance) is one device program (rltlab.engine.spec.draft_program); False = host loop.
    spec_pipeline: with a TreeProposer, up to this many programs per engine step, each
    launched from the last one's acceptance on the device (rltlab.engine.spec.tree_graph).
    spec_max_concurrency: with a proposer set, speculate only while at most this many
    sequences run; above it the engine decodes without speculation (and warns once). None:
    on CUDA rltlab.engine.spec.decoder.SPEC_MAX_CONCURRENCY_CUDA (8), or while a sequence
    samples SPEC_MAX_CONCURRENCY_CUDA_SAMPLED (1; both measured); no limit elsewhere.
    launch_behind_prompt: a lone request's first decode launch (a TreeProposer's program, or a
    plain-greedy request's token window) is queued behind its whole-prompt step, before token 0
    is read back (rltlab.engine.prompt_step); off by default.
    whole_prompt_steps: a step of fresh whole prompts with nothing else running runs their R
    rounds and samples their first tokens in one engine step (rltlab.engine.prompt_step).
    """

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
    prefill_first: bool = True
    token_window: int = 8
    window_chain: int = 8
    fused_prefill: bool = True
    cudnn_prefill_after: int | None = 16
    pad_prefill_attention: bool = False
    shared_prefix_attention: bool = True
    prefill_graph_tokens: int | None = None
    fused_spec: bool = True
    spec_pipeline: int = 16
    spec_max_concurrency: int | None = None
    launch_behind_prompt: bool = False
    whole_prompt_steps: bool = True

    def __post_init__(self) -> None:
        owner = "ExecutionConfig"
        for name in ("window_chain", "spec_pipeline"):
            _positive_int(owner, name, getattr(self, name))
        _positive_int(owner, "cudnn_prefill_after", self.cudnn_prefill_after, allow_none=True)
        _positive_int(owner, "spec_max_concurrency", self.spec_max_concurrency, allow_none=True)
        if self.prefill_graph_tokens is not None and (
                not isinstance(self.prefill_graph_tokens, int)
                or isinstance(self.prefill_graph_tokens, bool) or self.prefill_graph_tokens < 0):
            raise ValueError(f"{owner}.prefill_graph_tokens must be None or an int >= 0, got "
                             f"{self.prefill_graph_tokens!r}")
        for name in ("round_window", "token_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{owner}.{name} must be an int >= 0 (0 = off), got {value!r}")
        if isinstance(self.l2_prefetch_mb, bool) or not isinstance(
                self.l2_prefetch_mb, (int, float)) or not 0 <= self.l2_prefetch_mb < 1024:
            raise ValueError(f"{owner}.l2_prefetch_mb must be a number of MiB in [0, 1024), "
                             f"got {self.l2_prefetch_mb!r}")
        if self.decode_path not in DECODE_PATHS:
            raise ValueError(f"{owner}.decode_path must be one of {DECODE_PATHS}, "
                             f"got {self.decode_path!r}")
        for name in ("cuda_graphs", "compile", "small_batch_kernels", "pdl", "fused_qkv_rope",
                     "fused_tokens", "fused_prefill", "fused_spec", "prefill_first",
                     "pad_prefill_attention", "shared_prefix_attention", "whole_prompt_steps",
                     "launch_behind_prompt"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{owner}.{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.gemv_rows, bool) or not isinstance(self.gemv_rows, int) or \
                not 1 <= self.gemv_rows <= kernels.MAX_GEMV_ROWS:
            raise ValueError(f"{owner}.gemv_rows must be an int in "
                             f"1..{kernels.MAX_GEMV_ROWS}, got {self.gemv_rows!r}")


@dataclass
class EngineConfig:
    """What one engine may hold and what it computes.

    max_num_seqs: sequences holding KV blocks at once (one row each per step).
    max_num_batched_tokens: query tokens per step (one step = one round for every row).
    prefill_chunk: most prompt tokens one sequence puts in one chunk.
    block_size: tokens per KV block.
    num_blocks: KV blocks in the pool; None sizes it from kv_cache_memory_gib, capped at what
    max_num_seqs sequences of max_model_len tokens can use plus a draft tree's private blocks.
    kv_cache_memory_gib: memory for the KV pool; None = on CUDA, gpu_memory_utilization of the
    device's memory less what is in use once the model is loaded and an activation reserve
    (vLLM's rule), CPU_KV_CACHE_GIB on the CPU.
    gpu_memory_utilization: the share of the GPU's memory the engine may fill (with None above).
    max_model_len: prompt + output tokens of one sequence; None = min(model limit, 4096).
    dtype: "auto" (None) = bfloat16 on a GPU, float32 on the CPU; or a floating dtype.
    device: "auto" (None) = where a given model already is, or CUDA if available for a
    checkpoint path; or "cpu" / "cuda" / "cuda:N".
    logprobs_mode: "raw_logprobs" (the model's distribution) or "processed_logprobs" (after
    temperature / top-k / top-p), as vLLM.
    exit_policy / exit_policy_args: the default exit policy (a registered name) and the keyword
    arguments of its factory; a request may name another policy in its SamplingParams.
    exit_semantics: "last_exited" (a token stops at its exit round; deeper planes get its
    exit-round K/V) or "select_only" (every token runs all R rounds; the policy only selects
    the round its output comes from, as the Hugging Face Ouro code does). docs/ouro.md.
    default_min_loops: min_loops of requests that set none; None = 2 under last_exited,
    1 under select_only.
    execution: performance switches (ExecutionConfig).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 512
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    dtype: torch.dtype | str | None = None
    device: torch.device | str | None = None
    logprobs_mode: str = "raw_logprobs"
    exit_policy: str = "q_exit"
    exit_policy_args: dict[str, Any] = field(default_factory=dict)
    exit_semantics: str = "last_exited"
    default_min_loops: int | None = None
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)

    def __post_init__(self) -> None:
        owner = "EngineConfig"
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk", "block_size"):
            _positive_int(owner, name, getattr(self, name))
        for name in ("num_blocks", "max_model_len", "default_min_loops"):
            _positive_int(owner, name, getattr(self, name), allow_none=True)
        kv = self.kv_cache_memory_gib
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, (int, float))
                               or not math.isfinite(kv) or kv <= 0):
            raise ValueError(f"{owner}.kv_cache_memory_gib must be a finite number of GiB > 0 "
                             f"or None (sized from the free GPU memory), got {kv!r}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"{owner}.gpu_memory_utilization must be a number in (0, 1], "
                             f"got {util!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"{owner}.logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        if not isinstance(self.exit_policy, str) or not self.exit_policy:
            raise ValueError(f"{owner}.exit_policy must be a policy name, "
                             f"got {self.exit_policy!r}")
        if not isinstance(self.exit_policy_args, dict) or \
                not all(isinstance(key, str) for key in self.exit_policy_args):
            raise ValueError(f"{owner}.exit_policy_args must be a dict with str keys "
                             f"(keyword arguments of the policy's factory), got "
                             f"{self.exit_policy_args!r}")
        if self.exit_semantics not in EXIT_SEMANTICS:
            raise ValueError(f"{owner}.exit_semantics must be one of {EXIT_SEMANTICS}, "
                             f"got {self.exit_semantics!r}")
        if not isinstance(self.execution, ExecutionConfig):
            raise ValueError(f"{owner}.execution must be an ExecutionConfig, "
                             f"got {type(self.execution).__name__}")
        self.dtype = parse_dtype(self.dtype)
        if self.device is not None and self.device != AUTO:
            try:
                self.device = resolve_device(self.device)
            except ValueError as err:
                raise ValueError(f"{owner}.{err}") from None
        elif self.device == AUTO:
            self.device = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """EngineConfig from the flat keyword arguments LLM takes: ExecutionConfig's fields go
        to `execution`; an unknown name is a ValueError listing the known ones."""
        engine_names = {f.name for f in fields(cls)} - {"execution"}
        execution_names = {f.name for f in fields(ExecutionConfig)}
        unknown = set(kwargs) - engine_names - execution_names - {"execution"}
        if unknown:
            raise ValueError(f"unknown engine arguments {sorted(unknown)}; EngineConfig fields "
                             f"are {sorted(engine_names)}, ExecutionConfig fields "
                             f"{sorted(execution_names)}")
        execution = kwargs.pop("execution", None) or ExecutionConfig(
            **{k: kwargs.pop(k) for k in list(kwargs) if k in execution_names})
        if any(k in execution_names for k in kwargs):
            raise ValueError("give ExecutionConfig fields either flat or as execution=, "
                             "not both")
        return cls(execution=execution, **kwargs)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        return self.dtype or default_dtype(device)

    def use_static_decode(self, device: torch.device) -> bool:
        path = self.execution.decode_path
        return path == "static" or (path == "auto" and device.type == "cuda")

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

    def resolve_kv_cache_gib(self, device: torch.device) -> float:
        """The KV pool's memory: kv_cache_memory_gib, or on CUDA what gpu_memory_utilization
        leaves once the model is loaded and ACTIVATION_RESERVE_GIB kept free (a ValueError
        with the figures where that is nothing), CPU_KV_CACHE_GIB elsewhere."""
        if self.kv_cache_memory_gib is not None:
            return float(self.kv_cache_memory_gib)
        if device.type != "cuda":
            return CPU_KV_CACHE_GIB
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = (total * self.gpu_memory_utilization - used) / 2 ** 30 - ACTIVATION_RESERVE_GIB
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache on {device}: {used / 2 ** 30:.1f} of "
                f"{total / 2 ** 30:.1f} GiB in use, gpu_memory_utilization="
                f"{self.gpu_memory_utilization} and {ACTIVATION_RESERVE_GIB} GiB kept for "
                "activations; raise gpu_memory_utilization or set kv_cache_memory_gib")
        return budget

    def resolve_num_blocks(self, cfg, max_model_len: int, elem_size: int,
                           device: torch.device = torch.device("cpu")) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        per_block = (cfg.num_hidden_layers * 2 * cfg.num_rounds * self.block_size
                     * cfg.num_key_value_heads * cfg.head_dim * elem_size)
        from_memory = int(self.resolve_kv_cache_gib(device) * 2 ** 30) // per_block
        useful = (self.max_num_seqs * -(-max_model_len // self.block_size)
                  + SPECULATION_RESERVE_BLOCKS)
        return max(1, min(from_memory, useful))


ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig)) - {"execution"}
EXECUTION_FIELDS = frozenset(f.name for f in fields(ExecutionConfig))
