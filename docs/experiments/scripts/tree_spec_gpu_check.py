"""Why did the tree speculative decoder accept so few drafts on the H200 (s14_call4: tau 1.17
with the shipped B = 16 tree, against 2.56 on the CPU with the same heads and prompts)?
Runs the same 8 held-out prompts through rltlab.engine.tree_spec on the CPU, on the GPU
eagerly and on the GPU as a CUDA graph, first alone and then after an engine (LLM) was built
on the same model and has generated; prints tau, identical-token counts and the heads' logits
difference between CPU and GPU for the same input, then times one graph replay of each tree
with CUDA events (the iteration's GPU time) against the host loop's time per iteration.
Last line: JSON."""
import copy, json, time
import torch
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams
from rltlab.engine.tree_spec import TreeSpecGenerator
from rltlab.model.checkpoint import load_model

HEADS = "artifacts/ouro-tiny/draft_heads/lookahead_h4"
res = {}
cpu_model, tok, md = load_model(None, dtype="float32", device="cpu")
gpu_model = copy.deepcopy(cpu_model).cuda().eval()
cpu_heads, tree, _ = lookahead.load(HEADS, cpu_model)
gpu_heads, _, _ = lookahead.load(HEADS, gpu_model)
prompts = eval_prompts(tok, md, 16)[:4] + eval_prompts(tok, md, 16)[8:12]
h = torch.randn(5, cpu_model.config.hidden_size)
nxt = torch.randint(0, cpu_model.config.vocab_size, (5,))
with torch.no_grad():
    res["heads_max_abs_diff_cpu_gpu"] = float(
        (cpu_heads(h, nxt) - gpu_heads(h.cuda(), nxt.cuda()).cpu()).abs().max())


def run(tag, model, heads, graph):
    gen = TreeSpecGenerator(model, heads, tree, 128, cuda_graph=graph)
    outs = [gen.generate(p, 32, 0) for p in prompts]
    steps = sum(o.stats.steps for o in outs)
    res[tag] = {"tau": round(sum(o.stats.emitted for o in outs) / max(steps, 1), 3),
                "tokens": [o.token_ids for o in outs]}
    print(tag, res[tag]["tau"], flush=True)
    return gen


run("cpu", cpu_model, cpu_heads, False)
run("gpu eager", gpu_model, gpu_heads, False)
run("gpu graph", gpu_model, gpu_heads, True)
from torch.nn.attention import SDPBackend, sdpa_kernel
with sdpa_kernel(SDPBackend.MATH):
    run("gpu eager, math sdpa", gpu_model, gpu_heads, False)
llm = LLM(gpu_model, max_num_seqs=1, block_size=16, kv_cache_memory_gib=0.5, max_model_len=128)
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, exit_policy="fixed"))
with torch.no_grad():
    res["heads_max_abs_diff_after_llm"] = float(
        (cpu_heads(h, nxt) - gpu_heads(h.cuda(), nxt.cuda()).cpu()).abs().max())
run("gpu eager after llm", gpu_model, gpu_heads, False)
run("gpu graph after llm", gpu_model, gpu_heads, True)
ref = res["cpu"]["tokens"]
for tag in [k for k in res if isinstance(res[k], dict)]:
    res[tag]["identical_to_cpu"] = sum(a == b for a, b in zip(res[tag].pop("tokens"), ref))
# one graph replay's GPU time per tree (CUDA events), and the host loop per iteration
timing = {}
for name, t in (("root only", []), ("B=16", tree)):
    gen = TreeSpecGenerator(gpu_model, gpu_heads, t, 128)
    o = gen.generate(prompts[0], 32, 0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        gen._graph.replay()
    end.record()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    o = gen.generate(prompts[0], 32, 0)
    host = (time.perf_counter() - t0) / max(o.stats.steps, 1)
    timing[name] = {"replay_ms": start.elapsed_time(end) / 50, "generate_ms_per_iteration":
                    host * 1e3, "steps": o.stats.steps}
    print(name, timing[name], flush=True)
res["timing"] = timing
print(json.dumps(res))
