"""LLM: the offline front end (vLLM names): LLM(model_or_path).generate(prompts, params)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence as Seq

import torch
from tqdm.auto import tqdm

from rltlab.common.device import resolve_device
from rltlab.engine.config import EngineConfig
from rltlab.engine.inputs import check_prompts, check_sampling_params
from rltlab.engine.llm_engine import LLMEngine
from rltlab.engine.outputs import RequestOutput
from rltlab.engine.sampling import SamplingParams
from rltlab.engine.tokenize import encode_prompt
from rltlab.model.architecture import OuroForCausalLM


def build_engine(model_or_path, tokenizer=None, *, weight_version: int = 0,
                 **kwargs: Any) -> LLMEngine:
    """An LLMEngine from an OuroForCausalLM (+ tokenizer) or a local checkpoint directory.
    Keyword arguments are EngineConfig and ExecutionConfig fields, flat (or execution=...).
    A checkpoint loads on the config's device ("auto": CUDA where there is one) in its dtype
    ("auto": bfloat16 on a GPU, float32 on the CPU); a model stays where it is unless told."""
    config = EngineConfig.from_kwargs(**kwargs)
    private = isinstance(model_or_path, (str, os.PathLike))   # loaded here: no copy needed
    if private:
        from rltlab.model import checkpoint
        device = resolve_device(config.device)
        config.device, config.dtype = device, config.resolve_dtype(device)
        if (Path(model_or_path) / "tokenizer.json").is_file():
            model, loaded = checkpoint.load_model_and_tokenizer(model_or_path, config.dtype,
                                                                device)
            tokenizer = tokenizer or loaded
        else:   # a token-in / token-out checkpoint without a tokenizer
            model = checkpoint.from_pretrained(model_or_path, dtype=config.dtype, device=device)
    elif isinstance(model_or_path, OuroForCausalLM):
        model = model_or_path
    else:
        raise TypeError("LLM needs an OuroForCausalLM or a checkpoint directory, got "
                        f"{type(model_or_path).__name__}")
    return LLMEngine(model, config, tokenizer=tokenizer, weight_version=weight_version,
                     private_model=private)


class LLM:
    def __init__(self, model_or_path, tokenizer=None, *, weight_version: int = 0, **kwargs):
        self.llm_engine = build_engine(model_or_path, tokenizer, weight_version=weight_version,
                                       **kwargs)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def warm_up(self, *, concurrency: int | None = None, prompt_len: int | Seq[int] = 128,
                max_tokens: int = 32, group_size: int = 1, progress: bool = True) -> dict:
        """Pay a closed loop's one-off costs now (graph captures, kernel specialisations) by
        running synthetic loops of up to `concurrency` requests (default max_num_seqs) and
        prompts of up to `prompt_len` tokens, or of the given list of prompt lengths (fewer
        shapes: faster; rltlab.engine.warm_up); group_size: the loop's samples per prompt
        (SamplingParams.n: > 1 warms the grouped shapes too); prints the time it took.
        On the CPU there is nothing to warm: returns at once. -> {"seconds", "loops",
        "graphs"}."""
        from rltlab.engine.warm_up import warm_up
        result = warm_up(self.llm_engine, concurrency=concurrency, prompt_len=prompt_len,
                         max_tokens=max_tokens, group_size=group_size, progress=progress)
        if result["loops"]:
            print(f"warm-up: {result['loops']} synthetic loops, {result['graphs']} graphs, "
                  f"{result['seconds']:.1f} s")
        return result

    # ---------------------------------------------------------------------------- generate
    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None
                 = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: str, token-id list, {"prompt_token_ids": [...]} or a list of those.
        Returns one RequestOutput per prompt, in input order. use_tqdm: a bar over the
        finished requests on stderr, as vLLM's."""
        engine = self.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("generate() needs an idle engine: finish or abort the requests "
                               "added with add_request() first")
        if engine.paused:
            raise RuntimeError("generation is paused: resume_generation() first")
        check_prompts(prompts)
        check_sampling_params(sampling_params)
        token_lists, texts = self._tokenize(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(token_lists)
        else:
            params = list(sampling_params)
            if len(params) != len(token_lists):
                raise ValueError(f"{len(params)} sampling params for {len(token_lists)} prompts")
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(token_lists), desc="generate", unit="request", disable=not use_tqdm)
        try:
            for tokens, param in zip(token_lists, params):
                ids.append(engine.add_request(None, tokens, param))
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update()
        except BaseException:   # leave the engine idle: abort what this call started
            engine.abort_request(ids)
            engine._drain_outputs()
            raise
        finally:
            bar.close()
        for rid, text in zip(ids, texts):
            results[rid].prompt = text
        return [results[rid] for rid in ids]

    def _tokenize(self, prompts) -> tuple[list[list[int]], list[str | None]]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        tokens, texts = [], []
        for prompt in prompts:
            if isinstance(prompt, str):
                tokens.append(encode_prompt(self.get_tokenizer(), prompt))
                texts.append(prompt)
            elif isinstance(prompt, dict):
                tokens.append(list(prompt["prompt_token_ids"]))
                texts.append(prompt.get("prompt"))
            elif isinstance(prompt, torch.Tensor):
                tokens.append(prompt.tolist())
                texts.append(None)
            else:
                tokens.append(list(prompt))
                texts.append(None)
        return tokens, texts

    # --------------------------------------------------------------- incremental + updates
    def __getattr__(self, name: str):
        """add_request, step, abort_request, has_unfinished_requests, start_weight_update,
        update_weights, finish_weight_update, get_weight_version, pause_generation,
        resume_generation, reset_prefix_cache, add_round_observer, ...: the engine's."""
        if name == "llm_engine":
            raise AttributeError(name)
        return getattr(self.llm_engine, name)
