"""The kernels (backend triton) against the GPU reference (backend torch) on the same windows: for each preset,
the per-window paired difference of the two runs' ΔNLL (each against its own run's baseline), in points of %, with
its 95% t interval. Usage: python agreement.py TRITON_RESULTS_DIR TORCH_RESULTS_DIR [TORCH_RESULTS_DIR ...]
(the results directories of `hf-kvcache eval --backend triton|torch` on equal --prefill / --windows)."""

import json
import sys
from pathlib import Path

from hf_kvcache.eval.perplexity import paired_interval


def per_window(path: str) -> dict[str, tuple[list[float], list[float]]]:
    """spec -> (window NLLs, the same run's baseline NLLs)."""
    metrics = json.loads((Path(path) / "metrics.json").read_text())
    out, base = {}, None
    for entry in metrics["methods"]:
        (run,) = entry["decode"].values()  # one prefill length
        nll = [w["nll"] for w in run["windows"]]
        if entry["spec"] == metrics["baseline"]:
            base = nll
        else:
            out[entry["spec"]] = (nll, base)
    return out


def main(triton: str, *torch_dirs: str) -> None:
    fused = per_window(triton)
    reference = {k: v for d in torch_dirs for k, v in per_window(d).items()}
    print("| preset | kernels ΔNLL % | reference ΔNLL % | kernels - reference, points | 95% interval |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for spec, (nll_f, base_f) in fused.items():
        if spec not in reference:
            continue
        nll_r, base_r = reference[spec]
        scale_f, scale_r = 100 / (sum(base_f) / len(base_f)), 100 / (sum(base_r) / len(base_r))
        diffs = [(a - b) * scale_f - (c - d) * scale_r for a, b, c, d in zip(nll_f, base_f, nll_r, base_r)]
        d = paired_interval(diffs)
        f = (sum(nll_f) / sum(base_f) - 1) * 100
        r = (sum(nll_r) / sum(base_r) - 1) * 100
        worst = max(worst, abs(d["mean"]) + d["half_width"])
        print(f"| `{spec}` | {f:+.2f} | {r:+.2f} | {d['mean']:+.2f} | ± {d['half_width']:.2f} |")
    print(f"\nlargest |difference| + interval: {worst:.2f} points")


if __name__ == "__main__":
    main(*sys.argv[1:])
