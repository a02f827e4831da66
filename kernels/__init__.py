"""Kernels for the looped-LM engine (import as ``rltlab.kernels``).

Every kernel comes in two versions with the same arguments and results:
  * ``name``      - Triton; the engine uses these on CUDA tensors.
  * ``name_ref``  - plain torch; the engine uses these on CPU, and tests use them as the spec.
``triton_available(x)`` tells which one applies. On a machine without a GPU the Triton versions
still run (slowly) under the interpreter when TRITON_INTERPRET=1 is set before triton is imported.

KV cache layout: [num_layers, 2 (k, v), num_planes (= rounds), num_blocks, block_size, Hkv, D];
a token's slot is block_id * block_size + offset_in_block; plane p (0-based) holds round p + 1.
See docs/kernels.md.
"""

if __name__ == "kernels":
    # Found as a top-level `kernels` because the repository root is on sys.path (`python -m` or
    # `python -c` run from it). That name is Hugging Face's package, which transformers (>= 5)
    # imports: hand the name over to it rather than shadow it.
    from ._shadowed import hand_over

    hand_over(__file__)
else:
    import torch

    from .activation import silu_mul, silu_mul_ref
    from .fused_norm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
    from .greedy import greedy_tokens, greedy_tokens_ref
    from .interpreter import interpreter_problem
    from .l2_prefetch import prefetch_bytes
    from .kv_copy import last_exited_copy, last_exited_copy_ref, write_kv, write_kv_ref
    from .paged_attention import (
        paged_decode_attention,
        paged_decode_attention_ref,
        paged_decode_attention_torch,
        paged_prefill_attention,
        paged_prefill_attention_ref,
    )
    from .pdl import INTERPRETED, pdl_available
    from .rope_gemv import rope_kv_linear, rope_kv_linear_ref
    from .shared_prefix import MAX_MEMBERS, SharedPrefix, shared_prefix_plan
    from .small_batch import MAX_ROWS as MAX_GEMV_ROWS
    from .small_batch import rope_write_kv, rope_write_kv_ref, small_m_linear, small_m_linear_ref

    __all__ = [
        "add_rmsnorm", "add_rmsnorm_ref", "greedy_tokens", "greedy_tokens_ref",
        "interpreter_problem", "rmsnorm", "rmsnorm_ref",
        "last_exited_copy", "last_exited_copy_ref",
        "prefetch_bytes", "write_kv", "write_kv_ref",
        "paged_decode_attention", "paged_decode_attention_ref", "paged_decode_attention_torch",
        "paged_prefill_attention", "paged_prefill_attention_ref", "pdl_available",
        "rope_kv_linear", "rope_kv_linear_ref", "rope_write_kv", "rope_write_kv_ref",
        "MAX_GEMV_ROWS", "MAX_MEMBERS", "SharedPrefix", "shared_prefix_plan", "silu_mul",
        "silu_mul_ref", "small_m_linear", "small_m_linear_ref", "triton_available",
    ]


    def triton_available(device) -> bool:
        """True if the Triton kernels can run on ``device`` (a torch.device, str, or tensor).

        That is: CUDA, or any device when TRITON_INTERPRET=1 was set before
        this package was imported.
        """
        if isinstance(device, torch.Tensor):
            device = device.device
        if INTERPRETED:
            return True
        # triton itself is a hard dependency: the kernel modules imported above already import it.
        return torch.device(device).type == "cuda"
