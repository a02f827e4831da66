"""s14_call4's bench measured tau 1.17 for the shipped tree on the H200, while the decoder alone
on the same GPU gives the CPU's tau (s14_call5: 2.77 on 8 prompts). This replays the bench's
sequence of events on the GPU, one at a time, and prints the tree decoder's tau after each:
the model loaded straight to the GPU, an engine built on it, the engine generating, a
torch.compile'd decoder compiled and run. Last line: JSON."""
import json
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams
from rltlab.engine.tree_spec import TreeSpecGenerator
from rltlab.model.checkpoint import load_model

model, tok, md = load_model(None, dtype="float32", device="cuda")
model.eval()
heads, tree, _ = lookahead.load("artifacts/ouro-tiny/draft_heads/lookahead_h4", model)
prompts = eval_prompts(tok, md, 32)
max_len = max(map(len, prompts)) + 33
res = {}


def tau(tag, gen):
    outs = [gen.generate(p, 32, 0) for p in prompts]
    steps = sum(o.stats.steps for o in outs)
    res[tag] = round(sum(o.stats.emitted for o in outs) / max(steps, 1), 3)
    print(tag, res[tag], flush=True)
    return [o.token_ids for o in outs]


g0 = TreeSpecGenerator(model, heads, tree, max_len, cuda_graph=False)
tau("eager, no engine", g0)
g1 = TreeSpecGenerator(model, heads, tree, max_len)
tau("graph, no engine", g1)
llm = LLM(model, max_num_seqs=1, block_size=16, kv_cache_memory_gib=0.5, max_model_len=max_len)
tau("graph, engine built", g1)
params = SamplingParams(temperature=0.0, max_tokens=32, exit_policy="fixed")
ref = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
tau("graph, engine generated", g1)
g2 = TreeSpecGenerator(model, heads, tree, max_len)
tau("new graph after the engine", g2)
g3 = TreeSpecGenerator(model, heads, tree, max_len, cuda_graph=False)
tau("new eager after the engine", g3)
llm.generate(prompts, params)
toks = tau("graph, engine generated again", g1)
res["identical_to_engine"] = sum(a == b for a, b in zip(toks, ref))
c = TreeSpecGenerator(model, heads, tree, max_len, compile=True)
tau("compiled", c)
tau("graph after compile", g1)
tau("eager after compile", g0)
print(json.dumps(res))
