"""Checks of what LLM.generate / AsyncLLM.generate are given, before anything is tokenized or
queued: one ValueError line naming the field, instead of a KeyError('prompt_token_ids') three
calls later or "sampling params must be SamplingParams, got str" for a dict of settings.

A prompt is a str (text, tokenized by the engine), a sequence of token ids, a 1-D tensor of
them, or {"prompt_token_ids": ids} (optionally with "prompt", the text it came from, kept in
the output). `prompts` is one prompt or a list of them. The ids themselves (ints in the
vocabulary) are checked by LLMEngine.add_request, which names prompt_token_ids[i].
"""
from __future__ import annotations

from typing import Any

import torch

from rltlab.engine.sampling import SamplingParams

PROMPT_KEYS = ("prompt_token_ids", "prompt")


def _kind(value: Any) -> str:
    return type(value).__name__


def _is_id_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], int)


def check_prompt(prompt: Any, where: str = "prompt") -> None:
    """Raise ValueError naming `where` (and the field) if `prompt` is not one prompt."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(f"{where}: a tensor prompt must be 1-D token ids, got shape "
                             f"{tuple(prompt.shape)}")
        return
    if isinstance(prompt, dict):
        unknown = sorted(set(map(str, prompt)) - set(PROMPT_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} in a dict "
                             f"prompt; it takes 'prompt_token_ids' (required) and 'prompt' "
                             "(the text, kept in the output)")
        if "prompt_token_ids" not in prompt:
            raise ValueError(f"{where}: a dict prompt needs 'prompt_token_ids' (the token ids); "
                             "pass a text prompt as a plain str")
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple, torch.Tensor)):
            raise ValueError(f"{where}['prompt_token_ids'] must be a list of token ids, got "
                             f"{_kind(ids)}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{where}['prompt'] must be the prompt's text (a str) or None, got "
                             f"{_kind(text)}")
        return
    if isinstance(prompt, (list, tuple)):
        return      # token ids: checked one by one by add_request
    raise ValueError(f"{where} must be a str, a list of token ids or {{'prompt_token_ids': "
                     f"[...]}}, got {_kind(prompt)}")


def check_prompts(prompts: Any) -> None:
    """LLM.generate's `prompts`: one prompt or a list / tuple of them (module docstring)."""
    if isinstance(prompts, (str, dict, torch.Tensor)) or _is_id_list(prompts):
        check_prompt(prompts, "prompts")
        return
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {_kind(prompts)}")
    for i, prompt in enumerate(prompts):
        check_prompt(prompt, f"prompts[{i}]")


def check_sampling_params(params: Any, num_prompts: int | None = None, *,
                          single: bool = False) -> None:
    """LLM.generate's `sampling_params`: None, a SamplingParams, or a list / tuple of them (one
    per prompt: `num_prompts` of them, when given). single: one request's (AsyncLLM.generate):
    None or a SamplingParams only."""
    if params is None or isinstance(params, SamplingParams):
        return
    if single and isinstance(params, (list, tuple)):
        raise ValueError(f"sampling_params must be one SamplingParams (one prompt), got "
                         f"{_kind(params)}")
    if isinstance(params, dict):
        raise ValueError(f"sampling_params must be SamplingParams, got a dict "
                         f"({', '.join(map(str, params))}): pass SamplingParams(**settings)")
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"sampling_params must be SamplingParams or a list of them (one per "
                         f"prompt), got {_kind(params)}")
    for i, param in enumerate(params):
        if not isinstance(param, SamplingParams):
            hint = ": pass SamplingParams(**settings)" if isinstance(param, dict) else ""
            raise ValueError(f"sampling_params[{i}] must be SamplingParams, got "
                             f"{_kind(param)}{hint}")
    if num_prompts is not None and len(params) != num_prompts:
        raise ValueError(f"sampling_params: {len(params)} for {num_prompts} prompts (one per "
                         "prompt, or a single SamplingParams for all)")
