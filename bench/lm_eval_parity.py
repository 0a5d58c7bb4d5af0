"""lm-eval through our server equals lm-eval on HF transformers: the same multiple-choice task scored by lm-eval's
`local-completions` model against stage4's /v1/completions (echo + logprobs, prompts as token ids, as lm-eval sends
them) and by lm-eval's `hf` model on the same checkpoint.

    pip install "lm-eval[api]"   # (the `eval` extra of pyproject.toml)
    python -m bench lm-eval [--model DIR] [--out FILE.md]

The task (`bench/lm_eval_task/`) is written in this repository: 40 general-knowledge questions with 4 choices, so
no data set is fetched. Both runs are fp32 on the CPU with batch size 1; the results file gives the accuracies and
the largest difference between the two backends' log-likelihoods over every (question, choice) pair.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from . import meta

DEFAULT_MODEL = meta.ROOT / "models" / "SmolLM2-135M-Instruct"
TASK = "mini_mc"


def evaluate(model: str, model_args: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(meta.ROOT / "bench" / "lm_eval_task"))
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=tasks,
                                  batch_size=1, log_samples=True, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0)
    metrics = out["results"][TASK]
    # one log-likelihood per (question, choice): resps[c] = [(loglikelihood, is_greedy)]
    lls = [[float(r[0][0]) for r in s["resps"]] for s in sorted(out["samples"][TASK], key=lambda s: s["doc_id"])]
    return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"], "lls": lls}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench lm-eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--out", type=Path, default=None,
                    help="markdown file to write (default: bench/local/cpu-lm-eval.md, gitignored)")
    args = ap.parse_args(argv)
    out = (args.out or meta.LOCAL / "cpu-lm-eval.md").absolute()
    model = os.path.abspath(args.model)
    os.chdir(meta.ROOT)  # the task names its data file relative to the repository
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval

    from stage4_fast.harness import server_process

    run_info = meta.run_meta("python -m bench lm-eval", argv)
    load_start, t0 = meta.load(), time.perf_counter()
    with server_process(model) as server:
        ours = evaluate("local-completions", f"model={model},base_url={server.base_url}/v1/completions,"
                        f"tokenizer={model},tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    hf = evaluate("hf", f"pretrained={model},dtype=float32,device=cpu")
    diff = max(abs(a - b) for qa, qb in zip(ours["lls"], hf["lls"]) for a, b in zip(qa, qb))
    picks_equal = sum(max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
                      for a, b in zip(ours["lls"], hf["lls"]))
    lines = [
        "# lm-eval through the stage4 server vs lm-eval's HF backend",
        "",
        *meta.header_lines(run_info),
        f"- model: {meta.relative(model)}, fp32, CPU; lm-eval {lm_eval.__version__}, {run_info['versions']}",
        f"- task: `{TASK}` (`bench/lm_eval_task/`): {len(ours['lls'])} questions, 4 choices each, zero-shot; "
        "batch size 1 on both sides",
        f"- load average before: {load_start}, after: {meta.load()}; total {time.perf_counter() - t0:.0f} s",
        "",
        "| backend | acc | acc_norm |",
        "|---|---:|---:|",
        f"| lm-eval `local-completions` → stage4 server (`/v1/completions`, echo + logprobs) | {ours['acc']:.4f} | "
        f"{ours['acc_norm']:.4f} |",
        f"| lm-eval `hf` (transformers) | {hf['acc']:.4f} | {hf['acc_norm']:.4f} |",
        "",
        f"Largest difference between the two backends' log-likelihoods over all {sum(map(len, hf['lls']))} "
        f"(question, choice) pairs: {diff:.2e}; the same choice ranked first on {picks_equal} of "
        f"{len(hf['lls'])} questions.",
    ]
    text = "\n".join(lines) + "\n"
    meta.write_report(out, text)
    return 0 if ours["acc"] == hf["acc"] and ours["acc_norm"] == hf["acc_norm"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
