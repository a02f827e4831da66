"""AsyncLLM: asyncio front end for concurrent token-in / token-out rollouts.

One background task drives engine.step() while any request is unfinished. Steps run inline on
the event loop (one round per step, then `await asyncio.sleep(0)`), so every call below happens
between two steps and needs no lock. Cancelling a consumer (or closing its generator) aborts
its request and frees its blocks.

    llm = AsyncLLM(model)
    async for out in llm.generate(prompt_ids, SamplingParams(max_tokens=64), "req-1"):
        ...                                   # out.finished on the last one
    final = await llm.generate_final(prompt_ids, params)
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import torch

from rltlab.engine.inputs import check_prompt, check_sampling_params
from rltlab.engine.llm import build_engine
from rltlab.engine.llm_engine import LLMEngine
from rltlab.engine.outputs import RequestOutput
from rltlab.engine.sampling import SamplingParams
from rltlab.engine.tokenize import encode_prompt


class EngineShutdown(RuntimeError):
    """AsyncLLM.shutdown() ended this request (or the AsyncLLM is shut down)."""


class AsyncLLM:
    def __init__(self, model_or_path=None, tokenizer=None, *, engine: LLMEngine | None = None,
                 weight_version: int = 0, **kwargs):
        self.engine = engine or build_engine(model_or_path, tokenizer,
                                             weight_version=weight_version, **kwargs)
        self._queues: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False

    # ------------------------------------------------------------------------------ requests
    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, stream: bool = True
                       ) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs as tokens arrive (only the final one if stream=False).
        Raises EngineShutdown if shutdown() ends the request (or came before it)."""
        if self._closed:
            raise EngineShutdown("AsyncLLM is shut down: it takes no new requests")
        check_prompt(prompt)
        check_sampling_params(sampling_params, single=True)
        tokens = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        if isinstance(tokens, str):
            tokens = encode_prompt(self.engine.tokenizer, tokens)
        rid = self.engine.add_request(request_id, list(tokens), sampling_params, stream=stream)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._kick()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.engine.abort_request(rid)
                self._kick()

    async def generate_final(self, prompt, sampling_params: SamplingParams | None = None,
                             request_id: str | None = None) -> RequestOutput:
        final = None
        async for out in self.generate(prompt, sampling_params, request_id, stream=False):
            final = out
        return final

    async def abort(self, request_id: str) -> bool:
        found = self.engine.abort_request(request_id)
        self._kick()
        return found

    # ---------------------------------------------------------------------- weight updates
    async def pause_generation(self, mode: str = "keep") -> None:
        """keep: in-flight requests wait; abort: end them; wait: let them finish first."""
        if mode == "wait":
            while self.engine.get_num_unfinished_requests():
                await asyncio.sleep(0.001)
            mode = "keep"
        self.engine.pause_generation(mode)
        self._kick()

    async def resume_generation(self) -> None:
        self.engine.resume_generation()
        self._kick()

    async def start_weight_update(self, version: int) -> None:
        self.engine.start_weight_update(version)

    async def update_weights(self, named_tensors) -> int:
        return self.engine.update_weights(named_tensors)

    async def finish_weight_update(self) -> int:
        version = self.engine.finish_weight_update()
        self._kick()
        return version

    async def get_weight_version(self) -> int:
        return self.engine.get_weight_version()

    async def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    async def shutdown(self) -> None:
        """Stop the step loop and end every request still in the engine: each is aborted (its
        KV blocks freed now) and its consumer's generate raises EngineShutdown. A consumer whose
        final output was already delivered still gets it. Later generate calls raise too."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        running = list(self.engine.requests)
        if running:
            self.engine.abort_request(running)
        if self.engine.has_unfinished_requests():
            self.engine.step()      # collects the aborted requests' outputs (nothing runs)
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(EngineShutdown(
                f"AsyncLLM was shut down while request {rid!r} was running: it was aborted "
                "and its KV blocks freed"))

    # ------------------------------------------------------------------------------- the loop
    def _kick(self) -> None:
        if self._closed:
            return
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wakeup.set()

    def _can_step(self) -> bool:
        engine = self.engine
        return engine.has_unfinished_requests() and (not engine.paused or bool(engine._outputs))

    async def _run(self) -> None:
        while True:
            if not self._can_step():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:   # an engine bug: fail every waiting consumer
                for rid, queue in list(self._queues.items()):
                    queue.put_nowait(RuntimeError(f"engine step failed: {err!r}"))
                self.engine.abort_request(list(self.engine.requests))
                outputs = self.engine.step()
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            await asyncio.sleep(0)
