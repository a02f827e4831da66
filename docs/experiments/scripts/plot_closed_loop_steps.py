"""Plot closed-loop step timelines written by closed_loop_steps.py: one panel per mode, each
engine step a bar from its start to its end, coloured by kind, as tall as the decode rows it ran
(prefill-only and mixed steps also show their prefill tokens, on the right-hand axis). Where a closed loop's time goes
is easier to see than to read off the sums.

    python docs/experiments/scripts/plot_closed_loop_steps.py STEPS.json OUT.png [MODE ...]

STEPS.json: closed_loop_steps.py --out, or a committed file that holds its output under a key
(docs/benchmarks/data/2026-12-02-s2-steps-passes-h200.json: "steps_W4"). MODE: the results to
plot (default all).
"""
import argparse
import io
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt   # noqa: E402
import seaborn as sns   # noqa: E402

from rltlab.common.atomic import write_bytes_atomic   # noqa: E402

KIND_COLOURS = dict(zip(("window", "tokens", "decode", "mixed", "prefill"),
                        sns.color_palette("colorblind", 5)))


def load_results(path: str) -> tuple[str, dict]:
    """(workload, {mode: result}) from closed_loop_steps.py's JSON, bare or under a key."""
    with open(path) as f:
        data = json.load(f)
    if "results" not in data:
        nested = [v for v in data.values() if isinstance(v, dict) and "results" in v]
        if len(nested) != 1:
            raise ValueError(f"{path}: no closed_loop_steps.py output found (a 'results' key, "
                             f"at the top or one level down)")
        data = nested[0]
    return data.get("workload", "?"), data["results"]


def plot(results: dict, modes: list[str], title: str, out: str) -> None:
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 2.6 * len(modes)), sharex=True,
                             squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        result = results[mode]
        tokens_ax = ax.twinx()
        for end, kind, rows, prefill, seconds in result["timeline"]:
            if prefill:   # prefill-only and mixed steps: their prompt tokens, behind
                tokens_ax.bar(end - seconds, prefill, width=seconds, align="edge",
                              color=KIND_COLOURS["prefill"], alpha=0.5, linewidth=0)
            if rows:
                ax.bar(end - seconds, rows, width=seconds, align="edge",
                       color=KIND_COLOURS.get(kind, "grey"), linewidth=0)
        loop = result["closed_loop"]
        ax.set_title(f"{mode}: {loop['wall_s']:.2f} s, {loop['tok_s']:,.0f} tok/s", fontsize=10,
                     loc="left")
        ax.set_ylabel("decode rows")
        tokens_ax.set_ylabel("prefill tokens")
        ax.set_ylim(bottom=0)
        tokens_ax.set_ylim(bottom=0)
        ax.set_zorder(tokens_ax.get_zorder() + 1)   # decode rows in front of prefill tokens
        ax.patch.set_visible(False)
    axes[-1, 0].set_xlabel("seconds into the closed loop (steps synchronised)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOURS.values()]
    labels = [f"{kind} (decode rows)" for kind in KIND_COLOURS if kind != "prefill"]
    fig.legend(handles, labels + ["prefill tokens (right axis)"], loc="lower center", ncol=5,
               fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format=os.path.splitext(out)[1].lstrip(".") or "png")
    plt.close(fig)
    write_bytes_atomic(out, image.getvalue())   # never a half-written figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps_json")
    parser.add_argument("out")
    parser.add_argument("modes", nargs="*")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    workload, results = load_results(args.steps_json)
    modes = args.modes or list(results)
    missing = [m for m in modes if m not in results]
    if missing:
        parser.error(f"no results for {missing}; the file has {sorted(results)}")
    plot(results, modes, args.title or f"{workload} closed loop, by engine step", args.out)


if __name__ == "__main__":
    main()
