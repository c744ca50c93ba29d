"""The pipeline's wiring, declared once: dvc.yaml's stages in order, each with its command, entry
module, data dependencies, extra params and outputs, and the per-step stages inside `train`.
`opd dvc-yaml` (stages/tools/dvcyaml.py) generates dvc.yaml from it, and `opd stage NAME` takes its
names from it; torch-free, so that `opd --help` stays fast."""
from __future__ import annotations

RUN = "artifacts/runs/${run}"

# name: (command, entry module, deps besides code, extra params, outs/metrics/plots block)
PIPELINE = {
    "prepare": ("opd stage prepare --params params.yaml", "stages.prepare",
                ["data/prompt_seeds.json", "conf/arch"], ["run", "artifacts"],
                f"    outs:\n      - {RUN}/prepare.json:\n          cache: false\n"),
    "train": ("opd stage train --params params.yaml", "stages.train", [f"{RUN}/prepare.json"], [],
              f"    outs:\n      - {RUN}/train.json:\n          cache: false\n"
              "    # history.csv and metrics.json go to DVC's cache (not `cache: false`): an experiment's commit then\n"
              "    # carries them, so `dvc exp show` and `dvc plots diff` can compare experiments\n"
              f"    plots:\n      - {RUN}/history.csv:\n          x: step\n"),
    # metrics.json holds a few headline numbers under flat keys (one narrow `dvc exp show` column each);
    # the whole evaluation record is eval.json
    "evaluate": ("opd stage evaluate --params params.yaml", "stages.evaluate", [f"{RUN}/train.json"], [],
                 f"    metrics:\n      - {RUN}/metrics.json\n"
                 f"    outs:\n      - {RUN}/eval.json:\n          cache: false\n"
                 f"      - {RUN}/answers.json:\n          cache: false\n"),
    # eval.json: export.policy=best chooses by the evaluation
    "export": ("opd stage export --params params.yaml", "stages.export", [f"{RUN}/train.json", f"{RUN}/eval.json"],
               ["export"],
               "    outs:\n      - artifacts/export/${run}:\n          cache: false\n"),
    "report": ("opd stage report --params params.yaml", "stages.report",
               [f"{RUN}/train.json", f"{RUN}/history.csv", f"{RUN}/metrics.json", f"{RUN}/eval.json",
                f"{RUN}/answers.json"], [],
               f"    outs:\n      - {RUN}/report.html:\n          cache: false\n"),
}
STAGES = tuple(PIPELINE)  # dvc.yaml's stages, in order
STEPS = ("rollout", "align", "score", "update")  # the per-step store stages inside train (align: cross-tokenizer runs)
