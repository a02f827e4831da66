"""Programmatic dependent launch (PDL) for the one-row decode round's kernels.

At one row a decode round is ~12 small kernels per layer, and each one's launch, ramp-up and
tail leave HBM idle between the weight streams (the gain: docs/results.md E11). On
Hopper and newer a kernel launched with PDL may start while its predecessor in the stream is
still running: every kernel here first lets its own successor launch
(``gdc_launch_dependents``), then waits for its predecessor to finish and flush its writes
(``gdc_wait``) before it reads an activation or writes anything. Only reads of data that no
kernel of the round writes may come before the wait: the weights (a GEMV starts streaming its
first tile, a norm loads its weights, a kernel issues its L2 prefetch while the previous kernel
drains) and the round's index (the decode attention's context lengths and planes: the host's
copy of it runs before the round, and a PDL kernel starts only after every non-PDL one before
it has finished).

Every kernel waits unconditionally, so "finished" is transitive: when a kernel's wait returns,
every earlier kernel of the stream has finished too. A kernel launched without PDL (torch, cuBLAS)
waits for its predecessor as usual, and one launched with PDL after it starts only when it ends.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def await_previous_kernel(GDC: tl.constexpr):
    """Under PDL: let the next kernel launch, then wait until the previous one has finished."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


# triton.jit chose interpreter or compiler when the function above was defined (TRITON_INTERPRET
# at import time); setting the variable later has no effect, so record what actually happened.
INTERPRETED = isinstance(await_previous_kernel, InterpretedFunction)


def pdl_available(device) -> bool:
    """True if kernels may be launched with pdl=True on ``device``: a CUDA device of compute
    capability 9.0 or newer (Hopper), kernels compiled rather than interpreted."""
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    return (not INTERPRETED and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_options(pdl: bool, device) -> dict:
    """Launch keywords for a kernel with a ``GDC`` constexpr: PDL on or off (checked first)."""
    if not pdl:
        return {"GDC": False}
    if not pdl_available(device):
        raise ValueError("pdl=True needs a CUDA device of compute capability >= 9.0 and compiled "
                         f"(not interpreted) Triton kernels; got {device}")
    return {"GDC": True, "launch_pdl": True}
