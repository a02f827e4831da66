"""What the tree-speculation tests (test_tree_graph.py, test_tree_pipeline.py) share: a tiny
random model and prompts, a tree of 16 nodes 4 deep, an engine sized for it, an oracle drafter
that knows the reference continuation, and the host recompute of the acceptance rule."""
import itertools

import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.engine.spec.prompt_lookup import prompt_lookup_match, prompt_lookup_ref
from rltlab.model.architecture import OuroForCausalLM
from rltlab.model.config import OuroConfig

torch.set_num_threads(1)
VOCAB, DEPTH = 64, 4
TREE = [p for d in (1, 2, 3) for p in itertools.product((0, 1), repeat=d)] + [
    (0, 0, 0, 0), (1, 0, 0, 0)]
ENGINE = dict(block_size=DEPTH, decode_path="static", max_num_seqs=1, num_blocks=96,
              max_model_len=64)


def tree_model() -> OuroForCausalLM:
    cfg = OuroConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     total_ut_steps=4, max_position_embeddings=512)
    return OuroForCausalLM(cfg).init_weights(0, std=0.3).eval()


def tree_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 1, 6)]


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, exit_policy="fixed", **kw)


def token_lists(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


class Oracle(torch.nn.Module):
    """Lookahead 'heads' that know the reference output: after token x (the bonus), head k puts
    the token that followed x k + 1 places later at rank ranks[k - 1] and distinct wrong tokens
    around it (a table lookup, so it runs inside the device program). A token the output
    continues in two ways keeps its first continuation."""

    depth = DEPTH

    def __init__(self, output: list[int], ranks: tuple[int, ...]):
        super().__init__()
        table = torch.zeros(VOCAB, DEPTH, VOCAB)
        seen = set()
        for q, x in enumerate(output):
            if x not in seen:
                seen.add(x)
                for k in range(DEPTH):
                    true = output[q + k + 1] if q + k + 1 < len(output) else 1
                    order = [t for t in range(VOCAB) if t != true]
                    order.insert(ranks[k], true)
                    table[x, k, order] = -torch.arange(VOCAB, dtype=torch.float32)
        self.register_buffer("table", table)

    def forward(self, h, next_token):
        return self.table[next_token] + 0 * h[:, :1, None]


def make_engine(model, proposer=None, **kw):
    llm = LLM(model, **{**ENGINE, **kw})
    if proposer is not None:
        llm.set_proposer(proposer)
    return llm


_TARGETS: dict = {}


def target_tokens(model, prompts, max_tokens, **kw) -> list[list[int]]:
    """The target-only engine's greedy tokens (make_engine(model, **kw) without a proposer,
    greedy(max_tokens)), computed once per model, prompts, max_tokens and engine settings in a
    process: the parametrized cases compare against the same targets, and a target-only run
    costs more than the tree runs it checks. The model must not change after its first call
    (the cache holds it, so its id is not reused)."""
    key = (id(model), tuple(map(tuple, prompts)), max_tokens, tuple(sorted(kw.items())))
    if key not in _TARGETS:
        outs = make_engine(model, **kw).generate([list(p) for p in prompts], greedy(max_tokens))
        _TARGETS[key] = (model, token_lists(outs))
    return [list(t) for t in _TARGETS[key][1]]


def expected_stats(oracle: Oracle, output: list[int], max_tokens: int, tree=TREE, prompt=(),
                   lookup: int = 0, ngram: int = 3, adaptive: bool | str = False,
                   first_drafts: bool = False) -> tuple[int, int, int]:
    """(iterations, accepted drafts, nodes verified) by the tree's acceptance rule, recomputed
    on the host: the pending token output[i] verifies the drafts the oracle made after it (the
    nodes no deeper than the cap: the tokens still to emit, less one; 0 in the first iteration,
    which has no drafts unless a lookup chain supplies them), and a draft at depth j is
    accepted while the ranks of output[i + 1..i + j] form a tree path, or while the lookup
    chain's drafts from prompt + output[:i + 1] match output[i + 1..i + j]. adaptive: the
    lookup chain is verified in the first iteration and after one whose lookup drafts began
    with the first token it emitted; adaptive "agree": ... after one whose next lookup draft
    (from prompt + output[:i' + 1], i' the next pending token) is the oracle's rank-0 token
    after output[i'], or whose lookup drafts began with its first token and whose next drafts
    come from a match of 2 tokens or more. first_drafts: the first iteration verifies the
    oracle's drafts after token 0 too."""
    tree, i, steps, accepted, verified = set(tree), 0, 0, 0, 0
    drafted = first_drafts and bool(tree)
    hit = True
    while max_tokens - (i + 1) > 0:
        cap = min(max(DEPTH, lookup), max_tokens - (i + 1) - 1) if drafted or lookup else 0
        with_lookup = not adaptive or steps == 0 or hit
        verified += sum(len(p) <= cap for p in tree) * drafted + min(lookup, cap) * with_lookup
        path = ()
        for j in range(1, min(cap, DEPTH) + 1) if drafted else ():
            row = oracle.table[output[i], j - 1]
            rank = int((row > row[output[i + j]]).sum())
            if path + (rank,) not in tree:
                break
            path += (rank,)
        drafts = prompt_lookup_ref(list(prompt) + output[:i + 1], lookup, ngram)
        found = next((j for j in range(min(lookup, cap)) if drafts[j] != output[i + 1 + j]),
                     min(lookup, cap)) if with_lookup else 0
        n = max(len(path), found)
        hit = bool(drafts) and drafts[0] == output[i + 1]
        steps, accepted, i, drafted = steps + 1, accepted + n, i + n + 1, True
        if adaptive == "agree" and i < len(output):
            following, matched = prompt_lookup_match(list(prompt) + output[:i + 1], 1, ngram)
            first = int(oracle.table[output[i], 0].argmax())
            hit = following[0] == first or (hit and matched >= 2)
    return steps, accepted, verified
