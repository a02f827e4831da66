"""SamplingParams and the sampler.

Each sequence owns a torch.Generator; one uniform draw per sampled token (inverse CDF), none for
greedy rows. Log-probs are computed in fp32 from the same logits and never touch a generator, so
asking for them cannot change the sampled tokens.

raw_logprobs:       log_softmax(logits)[token]
processed_logprobs: log_softmax(processed)[token], processed = logits / temperature (skipped
                    at temperature 0) with tokens outside top-k / top-p set to -inf.

A temperature below SAMPLING_EPS is greedy (vLLM's rule): SamplingParams stores it as 0.0, and
process_logits does not scale rows below it. Dividing by such a temperature is not a sharper
distribution but a numerical accident: 1e-300 rounds to 0 in fp32 (the old code then sampled
at T = 1) and 1e-45..1e-38 overflow the logits to inf (NaN probabilities).
"""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from typing import Any

import torch

from rltlab.common.device import to_device
from rltlab.model.generate import SAMPLING_EPS

_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MOD = 2 ** 63
# Most samples one request may ask for (SamplingParams.n). Every sample is a Sequence with its
# own torch.Generator from add_request on, queued until the scheduler admits it in parts of
# max_num_seqs: n = 2 * 10**5 took 5.8 s and 667 MB in add_request, 10**8 never returned.
MAX_N = 2 ** 16


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(name: str, value: Any, what: str) -> None:
    raise ValueError(f"SamplingParams.{name} {what}, got {value!r}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # -1 (or 0): all tokens
    max_tokens: int = 16
    seed: int | None = None         # None: a fresh seed, reported in the effective params
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)   # strings that end the output (vLLM)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None     # None: none; 0: the selected token's; k: plus the top k
    min_loops: int | None = None    # None: the engine default (2, at most the model's R)
    max_loops: int | None = None    # None: the model's R
    exit_threshold: float | None = None   # None: the model config's early_exit_threshold
    exit_policy: str | None = None  # None: the engine's default policy
    exit_policy_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            _fail("n", self.n, f"must be an int >= 1 and <= {MAX_N} (rltlab.engine.sampling."
                  "MAX_N: each sample is a sequence of its own; ask in several requests)")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not 0.0 <= self.temperature < float("inf"):
            _fail("temperature", self.temperature, "must be a finite float >= 0")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0   # greedy (the effective params say so)
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "must lie in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", self.top_k, "must be an int >= -1 (-1 or 0 = all tokens)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "must be an int >= 1")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _SEED_MOD):
            _fail("seed", self.seed, "must be None or an int in [0, 2**63)")
        if not isinstance(self.stop_token_ids, (list, tuple)) or \
                not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "must be a list of token ids >= 0")
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or \
                not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", self.stop, "must be a string or a list of non-empty strings")
        self.stop = list(self.stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            _fail("include_stop_str_in_output", self.include_stop_str_in_output, "must be a bool")
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "must be a bool")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            _fail("logprobs", self.logprobs, "must be None or an int >= 0")
        for name in ("min_loops", "max_loops"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                _fail(name, value, "must be None or an int >= 1")
        if self.min_loops is not None and self.max_loops is not None \
                and self.min_loops > self.max_loops:
            _fail("max_loops", self.max_loops, f"must be >= min_loops={self.min_loops}")
        if self.exit_threshold is not None and (
                not isinstance(self.exit_threshold, (int, float))
                or not 0.0 <= self.exit_threshold <= 1.0):
            _fail("exit_threshold", self.exit_threshold, "must be None or lie in [0, 1]")
        if self.exit_policy is not None and (not isinstance(self.exit_policy, str)
                                             or not self.exit_policy):
            _fail("exit_policy", self.exit_policy, "must be None or a policy name")
        if not isinstance(self.exit_policy_args, dict):
            _fail("exit_policy_args", self.exit_policy_args, "must be a dict")

    def resolve(self, *, num_rounds: int, vocab_size: int, default_min_loops: int,
                default_threshold: float, default_policy: str) -> "SamplingParams":
        """The effective params of a request: every None filled in, model limits checked."""
        for token in self.stop_token_ids:
            if token >= vocab_size:
                _fail("stop_token_ids", self.stop_token_ids,
                      f"holds ids outside the vocabulary of {vocab_size}")
        if self.logprobs is not None and self.logprobs > vocab_size:
            _fail("logprobs", self.logprobs, f"exceeds the vocabulary size {vocab_size}")
        max_loops = num_rounds if self.max_loops is None else self.max_loops
        min_loops = min(default_min_loops, max_loops) if self.min_loops is None else self.min_loops
        if not 1 <= max_loops <= num_rounds:
            _fail("max_loops", max_loops, f"must lie in [1, {num_rounds}] (the model's rounds)")
        if not 1 <= min_loops <= max_loops:
            _fail("min_loops", min_loops, f"must lie in [1, max_loops={max_loops}]")
        seed = secrets.randbelow(_SEED_MOD) if self.seed is None else self.seed
        threshold = default_threshold if self.exit_threshold is None else self.exit_threshold
        return dataclasses.replace(
            self, min_loops=min_loops, max_loops=max_loops, exit_threshold=float(threshold),
            seed=seed, exit_policy=self.exit_policy or default_policy,
            exit_policy_args=dict(self.exit_policy_args))

    def sample_seed(self, index: int) -> int:
        """Seed of sample `index` of n: the request's seed for sample 0, derived ones after."""
        assert self.seed is not None, "resolve() first"
        return (self.seed + index * _SEED_MIX) % _SEED_MOD


# ----------------------------------------------------------------------------------- sampler
def needs_filtering(params, vocab: int) -> bool:
    """Whether any of these SamplingParams keeps fewer than all tokens (top-k < V, top-p < 1)."""
    return any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params)


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, filtering: bool | None = None) -> torch.Tensor:
    """fp32 logits [N, V] -> processed logits (temperature, then top-k and top-p as -inf).
    filtering: whether any row has top-k < V or top-p < 1 (None: read it from the tensors,
    a device sync; the sampler knows it from the params)."""
    logits = logits.float()
    scale = torch.where(temperature >= SAMPLING_EPS, temperature, torch.ones_like(temperature))
    processed = logits / scale[:, None]
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if filtering is None:
        filtering = bool((k < vocab).any()) or bool((top_p < 1.0).any())
    if filtering:
        sorted_vals, order = processed.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        drop = rank >= k[:, None]
        probs = torch.softmax(sorted_vals.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs   # mass of strictly better tokens
        drop = drop | ((before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (rank > 0))
        drop = torch.zeros_like(drop).scatter(-1, order, drop)
        processed = processed.masked_fill(drop, float("-inf"))
    return processed


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


@dataclass
class DeviceSample:
    """sample_on_device's result, still on the device (no host sync yet)."""
    tokens: torch.Tensor                  # int64 [N]
    logprobs: torch.Tensor | None         # fp32 [N], the chosen tokens' (any row asked)
    logp: torch.Tensor | None             # fp32 [N, V], for top log-probs on the host


# Device copies of a batch's sampling parameters, by device and the rows' (temperature, top-k,
# top-p): a running batch keeps its composition for many tokens, and on a small model each
# upload (pinned host tensor + copy) costs more than the sampling itself.
_PARAM_TENSORS: dict[tuple, tuple] = {}
_PARAM_TENSORS_MAX = 256


def _param_tensors(params: list[SamplingParams], sampled: list[int], device: torch.device
                   ) -> tuple:
    """(temperature fp32 [N], top-k int64 [N], top-p fp32 [N], the sampled rows (those of
    temperature >= SAMPLING_EPS) int64 or None) on `device`, uploaded once per batch
    composition (never written by their users)."""
    key = (str(device), tuple((p.temperature, p.top_k, p.top_p) for p in params))
    cached = _PARAM_TENSORS.get(key)
    if cached is None:
        if len(_PARAM_TENSORS) >= _PARAM_TENSORS_MAX:
            _PARAM_TENSORS.clear()
        cached = (to_device([p.temperature for p in params], torch.float32, device),
                  to_device([p.top_k for p in params], torch.int64, device),
                  to_device([p.top_p for p in params], torch.float32, device),
                  to_device(sampled, torch.int64, device) if sampled else None)
        _PARAM_TENSORS[key] = cached
    return cached


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator], logprobs_mode: str) -> DeviceSample:
    """One token per row of logits [N, V], row i drawn with generators[i] and params[i], all
    on the device: greedy rows take the argmax; sampled rows invert their CDF at one uniform
    draw each from their own generator (one launch per row, no read-back), as a batch."""
    device, vocab = logits.device, logits.shape[-1]
    logits = logits.float()
    filtering = needs_filtering(params, vocab)
    sampled = [row for row, p in enumerate(params) if p.temperature >= SAMPLING_EPS]
    if filtering or sampled:
        temperature, top_k, top_p, rows = _param_tensors(params, sampled, device)
        processed = process_logits(logits, temperature, top_k, top_p, filtering)
    else:   # all greedy, nothing filtered: processing would divide by 1 (no launches needed)
        processed = logits
    tokens = processed.argmax(dim=-1)
    if sampled:
        probs = torch.softmax(processed.index_select(0, rows), dim=-1)
        u = torch.stack([torch.rand((), generator=generators[row], device=generators[row].device)
                         .to(device) for row in sampled])
        cdf = probs.cumsum(dim=-1)
        idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
        idx = idx.squeeze(1).clamp(max=vocab - 1)
        # u * total rounded up onto the end of the support: the last token it holds
        off = probs.gather(1, idx[:, None]).squeeze(1) <= 0
        last = vocab - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
        tokens = tokens.index_copy(0, rows, torch.where(off, last, idx))
    if all(p.logprobs is None for p in params):
        return DeviceSample(tokens, None, None)
    logp = torch.log_softmax(logits if logprobs_mode == "raw_logprobs" else processed, dim=-1)
    return DeviceSample(tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), logp)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator], logprobs_mode: str) -> SampleResult:
    """sample_on_device, read back: tokens, the chosen tokens' log-probs where asked, and the
    top `logprobs` log-probs of rows that ask for more than the chosen one."""
    drawn = sample_on_device(logits, params, generators, logprobs_mode)
    result = SampleResult(drawn.tokens.tolist(), [None] * len(params), [None] * len(params))
    if drawn.logprobs is None:
        return result
    chosen = drawn.logprobs.tolist()
    for row, param in enumerate(params):
        if param.logprobs is None:
            continue
        result.logprobs[row] = chosen[row]
        if param.logprobs > 0:
            vals, ids = drawn.logp[row].topk(param.logprobs)
            result.top_logprobs[row] = dict(zip(ids.tolist(), vals.tolist()))
    return result


def plain_greedy(params: list[SamplingParams], vocab_size: int) -> bool:
    """Every row greedy, unfiltered and without log-probs: its argmax is the whole sample
    (ModelRunner.greedy takes it in one kernel, with the finite flags)."""
    return all(p.temperature < SAMPLING_EPS and p.logprobs is None for p in params) and \
        not needs_filtering(params, vocab_size)


def sample_finite(runner, hidden: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator], logprobs_mode: str, before_read=None
                  ) -> tuple[list[bool], SampleResult | None]:
    """Tokens for the host from rows h [N, H] (runner: a ModelRunner) -> (each row's logits
    finite, `sample`'s result over the finite rows in order, None if none is). Plain greedy
    rows (token 0 of every request at c = 1) take runner.greedy's argmax and finite flags in
    one read-back, where the sampler's path syncs twice; before_read(tokens, finite), given,
    is called with them on the device once their copy to the host is queued and before the
    host waits for it (the device work it launches runs behind the copy): for plain greedy
    rows, and for a lone sampled row without log-probs."""
    if plain_greedy(params, runner.model.config.vocab_size):
        tokens, finite = runner.greedy(hidden)
        flat = _read_back(torch.cat([tokens, finite.long()]),
                          before_read and (lambda: before_read(tokens, finite)))
        finite = [bool(ok) for ok in flat[len(params):]]
        kept = [token for token, ok in zip(flat, finite) if ok]
        none = [None] * len(kept)
        return finite, SampleResult(kept, none, list(none)) if kept else None
    logits = runner.logits(hidden)
    if before_read is not None and len(params) == 1 and params[0].logprobs is None:
        # a lone sampled row (a tree program launched behind the prompt, prompt_step.py):
        # drawn before its finite flag is read, which costs a non-finite row (whose request
        # then ends in error) one draw; a finite row's token is the one drawn below
        finite_t = torch.isfinite(logits).all(dim=-1)
        tokens = sample_on_device(logits, params, generators, logprobs_mode).tokens
        token, ok = _read_back(torch.cat([tokens, finite_t.long()]),
                               lambda: before_read(tokens, finite_t))
        return [bool(ok)], SampleResult([token], [None], [None]) if ok else None
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    keep = [i for i, ok in enumerate(finite) if ok]
    if not keep:
        return finite, None
    return finite, sample(logits[keep], [params[i] for i in keep],
                          [generators[i] for i in keep], logprobs_mode)


def _read_back(values: torch.Tensor, meanwhile=None) -> list:
    """values.tolist(), with meanwhile() called after the copy is queued: a plain tolist() on
    CUDA would wait for whatever meanwhile() launched, queued before its copy."""
    if meanwhile is None:
        return values.tolist()
    if not values.is_cuda:
        out = values.tolist()
        meanwhile()
        return out
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    meanwhile()
    copied.synchronize()
    return host.tolist()


def q_exit_params(threshold: float, max_tokens: int, *, min_loops: int = 1, seed: int = 0,
                  temperature: float = 0.0, eos_token_id: int | None = None):
    """SamplingParams of the stock Q-exit at `threshold` (1.0 = full depth)."""
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                          exit_threshold=float(threshold), min_loops=min_loops,
                          exit_policy="q_exit",
                          stop_token_ids=[eos_token_id] if eos_token_id is not None else [])


def fixed_params(depth: int, max_tokens: int, *, seed: int = 0, temperature: float = 0.0,
                 eos_token_id: int | None = None):
    """SamplingParams of the fixed-depth policy at `depth` rounds."""
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                          min_loops=1, exit_policy="fixed", exit_policy_args={"depth": int(depth)},
                          stop_token_ids=[eos_token_id] if eos_token_id is not None else [])
