"""s14_call4's tree bench (two torch.compile'd trees, B = 64, on the H200) gave tau ~1.2 for every
config; s14_call7 (one compiled tree, no B = 64) and s14_call6 gave the CPU's tau. This builds
call 4's set of decoders - root only, the shipped tree compiled, B = 32 compiled, B = 64, the
shipped tree - and prints each one's tau on 12 held-out prompts, twice (CPU: 1.0 / 2.842 /
2.978 / 3.244 / 2.842). Last line: JSON."""
import json
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine.tree_spec import TreeSpecGenerator
from rltlab.model.checkpoint import load_model
m, tok, md = load_model(None, device="cuda"); m.eval()
heads, tree, _ = lookahead.load("artifacts/ouro-tiny/draft_heads/lookahead_h4", m)
DATA = "docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json"
trees = json.load(open(DATA))["result"]["trees"]
ps = eval_prompts(tok, md, 32)[:6] + eval_prompts(tok, md, 32)[16:22]
ml = max(map(len, ps)) + 33


def tau(g):
    o = [g.generate(p, 32, 0) for p in ps]
    return round(sum(x.stats.emitted for x in o) / sum(x.stats.steps for x in o), 3)


gs = {"root": TreeSpecGenerator(m, heads, [], ml),
      "a16c": TreeSpecGenerator(m, heads, tree, ml, compile=True),
      "b32c": TreeSpecGenerator(m, heads, [tuple(p) for p in trees["tree B=32"]], ml, compile=True),
      "b64": TreeSpecGenerator(m, heads, [tuple(p) for p in trees["tree B=64"]], ml),
      "a16": TreeSpecGenerator(m, heads, tree, ml)}
for rep in range(2):
    res = {k: tau(g) for k, g in gs.items()}
    print(json.dumps(res), flush=True)
