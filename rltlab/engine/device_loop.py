"""A request's tree programs looped on the device (EngineConfig.device_loop; experimental).

TreeGraph.run reads each program's output back and launches the next one from the host: on
the idle timelines of docs/benchmarks/2026-12-05-s28-h200-h100.md the device waits 37-64 us
for that turn, once a program. With the device loop the request's first program is launched
as before and, right behind it, one CUDA graph (csrc/tree_loop.cu) that runs the rest:

    decide -> WHILE(go) { IF(rows) program with the lookup chain's rows ELSE without;
                          decide }

`decide` is a captured graph of one kernel (rltlab.kernels.loop_decide) and two copies: it
appends the last program's output row to a ring, sets go (the sequence is live, its logits
finite, it has tokens left, none of the emitted tokens is a stop token, fewer than `launches`
programs ran: TreeGraph.run's own test) and rows (the proposer's rule, as TreeGraph.run's
lookup_next), then copies the ring and its count to pinned host memory. The host polls the
count and handles each row as it does a read-back, while the device goes on.

Timed on two H100 starts (docs/benchmarks/2026-12-06-s30-h100.md), the loop is slower than the
host loop: 0.928 paired with the first decide (~25 captured torch ops, 44 us a decide), 0.983
with this one-kernel decide (11.5 us). Hence experimental and off by default.

On CUDA this needs CUDA graphs (EngineConfig.cuda_graphs), a torch that keeps a captured
graph's cudaGraph_t (CUDAGraph(keep_graph=True)), nvcc to build csrc/tree_loop.cu once (cached
under $RLTLAB_CACHE, default ~/.cache/rltlab) and CUDA >= 12.8 (IF/ELSE nodes). Where any is
missing, TreeGraph.run keeps its host loop and names the reason (TreeGraph.device_loop_error,
and one warning). Without CUDA graphs the same decide and programs run eagerly in a Python
loop: the same tokens and spec_stats as the host loop (tests/test_device_loop.py).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

from rltlab.kernels import loop_decide, loop_decide_ref, triton_available

MAX_STOPS = 8   # stop tokens the device compares against (more: the host loop)
SOURCE = Path(__file__).with_name("csrc") / "tree_loop.cu"
_native: ctypes.CDLL | str | None = None   # the library, or why it cannot be built


class DeviceLoopUnavailable(RuntimeError):
    """The device loop cannot run here (the message says why); the host loop runs instead."""


def native_library() -> ctypes.CDLL:
    """csrc/tree_loop.cu compiled for this GPU (once per source, nvcc and architecture; then
    loaded from the cache) -> its ctypes handle, or DeviceLoopUnavailable."""
    global _native
    if _native is None:
        try:
            _native = _build()
        except DeviceLoopUnavailable as err:
            _native = str(err)
    if isinstance(_native, str):
        raise DeviceLoopUnavailable(_native)
    return _native


def _build() -> ctypes.CDLL:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    nvcc = shutil.which("nvcc") or str(Path(home) / "bin" / "nvcc")
    if not Path(nvcc).is_file():
        raise DeviceLoopUnavailable("nvcc not found (put it on PATH or set CUDA_HOME)")
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    digest = hashlib.sha256(SOURCE.read_bytes() + f"{arch} {Path(nvcc).resolve()}".encode())
    cache = Path(os.environ.get("RLTLAB_CACHE", Path.home() / ".cache" / "rltlab"))
    target = cache / "device_loop" / f"tree_loop-{digest.hexdigest()[:16]}.so"
    if not target.is_file():   # built beside it, then renamed: never a half-written library
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        built = subprocess.run([nvcc, "-O2", "-shared", "-Xcompiler", "-fPIC", "-cudart",
                                "shared", f"-arch={arch}", str(SOURCE), "-o", str(partial)],
                               capture_output=True, text=True)
        if built.returncode:
            partial.unlink(missing_ok=True)
            raise DeviceLoopUnavailable(f"nvcc could not build {SOURCE.name} for {arch}: "
                                        f"{built.stderr.strip()[-400:]}")
        os.replace(partial, target)
    lib = ctypes.CDLL(str(target))
    lib.build_tree_loop.argtypes = [ctypes.c_void_p] * 4 + [ctypes.POINTER(ctypes.c_void_p)]
    lib.launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.error_string.restype = ctypes.c_char_p
    return lib


def keeps_graphs() -> bool:
    """Whether this torch's CUDAGraph can keep its cudaGraph_t (keep_graph=True)."""
    try:
        torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return False
    return True


class DeviceLoop:
    """The loop over one TreeGraph's programs of one iteration each (chain 1): programs maps
    lookup rows (True / False) to the program; True's buffers are every program's."""

    def __init__(self, tree, programs: dict, capacity: int):
        lead = programs[True]
        dev, self.width = lead.out.device, lead.width
        self.tree, self.programs, self.capacity = tree, programs, capacity
        self.limit = torch.zeros(1, dtype=torch.long, device=dev)
        self.stops = torch.full((MAX_STOPS,), -1, dtype=torch.long, device=dev)
        self.count = torch.zeros(1, dtype=torch.long, device=dev)
        self.ring = torch.zeros(capacity, self.width, dtype=torch.long, device=dev)
        self.flags = torch.zeros(2, dtype=torch.int32, device=dev)   # [go on, next rows]
        pin = lead.static.cuda_graphs
        self._host_ring = torch.zeros(self.ring.shape, dtype=torch.long, pin_memory=pin)
        self._host_count = torch.zeros(1, dtype=torch.long, pin_memory=pin)
        self._seen = self._host_count.numpy()   # polled without a torch call
        self._stop_rows: dict[frozenset, torch.Tensor] = {}
        self._exec, self._done = None, None
        self._decide_step = loop_decide if triton_available(lead.out) else loop_decide_ref
        if pin:
            self._lib = native_library()
            self._decide()                       # warm-up outside the capture
            self._decide_graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(self._decide_graph):
                self._decide()
            without = programs.get(False, lead)
            exec_ = ctypes.c_void_p()
            self._check(self._lib.build_tree_loop(
                lead._graph.raw_cuda_graph(), without._graph.raw_cuda_graph(),
                self._decide_graph.raw_cuda_graph(), self.flags.data_ptr(), ctypes.byref(exec_)))
            self._exec = exec_

    def _check(self, err: int) -> None:
        if err:
            raise DeviceLoopUnavailable(f"CUDA: {self._lib.error_string(err).decode()}")

    def _decide(self) -> None:
        """The last program's output row into the ring (and the host's copy); flags = [go
        on, the next program's rows], by TreeGraph.run's rules (rltlab.kernels.loop_decide:
        one kernel where Triton runs)."""
        lead = self.programs[True]
        # index[2]: the next program's tokens left (a follow program's input)
        self._decide_step(lead.out[: self.width], lead.index[2:3], self.count, self.ring,
                          self.limit, self.stops, self.flags, self.tree.proposer.span,
                          self.tree.proposer.adaptive_lookup)
        self._host_ring.copy_(self.ring, non_blocking=True)
        self._host_count.copy_(self.count, non_blocking=True)

    def accepts(self, launches: int, stops: frozenset) -> bool:
        return launches <= self.capacity and len(stops) <= MAX_STOPS

    def launch(self, launches: int, stops: frozenset) -> None:
        """Right behind the request's first program: the loop over up to launches - 1 more."""
        if self._exec is not None and self._done is not None:
            self._done.synchronize()       # a loop whose rows were not all read: let it end
        self.limit.fill_(launches)
        if stops not in self._stop_rows:   # on the device once per set: no host copy later
            row = sorted(stops) + [-1] * (MAX_STOPS - len(stops))
            self._stop_rows[stops] = torch.tensor(row, device=self.stops.device)
        self.stops.copy_(self._stop_rows[stops])
        self.count.zero_()
        self._seen[0] = 0
        if self._exec is not None:
            self._check(self._lib.launch(self._exec, torch.cuda.current_stream().cuda_stream))
            self._done = torch.cuda.Event()
            self._done.record()
            return
        self._decide()                     # without CUDA graphs: the same steps, eagerly
        while self.flags[0]:
            self.programs[bool(self.flags[1])]._program()
            self._decide()

    def row(self, i: int) -> list[int]:
        """Program i's output row, once the device has copied it to the host (polled)."""
        while self._seen[0] <= i:
            if self._exec is not None and self._done.query() and self._seen[0] <= i:
                raise RuntimeError(f"the device loop ended before program {i}: its rules and "
                                   "TreeGraph.run's disagree")
        return self._host_ring[i].tolist()
