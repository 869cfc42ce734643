"""The TRL side of `bench/peer_trl.py`: TRL's `GRPOTrainer` on the bench's work, in a process
of its own, run by the python of the TRL venv the bench made (never imported by flexmarl).

    <trl-venv>/bin/python bench/_trl_grpo.py SPEC.json

SPEC (written by `bench/peer_trl.py`): `repo`, `config` and `overrides` (the flexmarl config
the flexmarl side runs: sampling, learning rate, group size, reward and problems are read from
it), `model` (the SFT start as an HF folder), `data` (one row per prompt, in flexmarl's
order: `prompt` as flexmarl renders it, `prompt_ids` as flexmarl tokenizes it, and the problem),
`iterations`, `threads`, `seed`, `out`. The reward is the workload's own `reward` (flexmarl_core's
config and workload modules are pure Python and pydantic, imported from the checkout), on the
completion's text cut at the agent's stop strings as flexmarl's engine cuts it. Writes
`out/result.json` (completion tokens, the training loop's span, per-step seconds, versions) and
the trained model under `out/final`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(int(spec["threads"]))
    sys.path.insert(0, spec["repo"])
    from flexmarl_core.config import load_config
    from flexmarl_core.workloads import make_workload
    from flexmarl_core.workloads.api import Problem

    cfg = load_config(spec["config"], spec["overrides"])
    agent = cfg.team.agents[0]
    sampling, algo = agent.sampling, agent.algorithm
    workload = make_workload(cfg.workload, cfg.team)
    rows = json.loads(Path(spec["data"]).read_text())

    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(spec["model"])
    # TRL tokenizes a plain-text prompt itself: it must see the ids flexmarl's engine sees.
    for r in rows:
        if tok(text=r["prompt"])["input_ids"] != r["prompt_ids"]:
            raise SystemExit(f"TRL's tokenization of prompt {r['input_id']!r} differs from flexmarl's")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    generated = [0]

    def cut(text: str) -> str:
        at = [i for i in (text.find(s) for s in sampling.stop if s) if i >= 0]
        return text[: min(at)] if at else text

    def reward(prompts, completions, completion_ids, input_id, text, answer, meta, **_kw):  # noqa: ANN001
        generated[0] += sum(len(c) for c in completion_ids)
        return [workload.reward(Problem(i, t, a, json.loads(m)), {agent.name: cut(c)})[agent.name]
                for c, i, t, a, m in zip(completions, input_id, text, answer, meta, strict=True)]

    class Clock(TrainerCallback):
        """The loop's span (its first step's start to its last step's end) and each step's."""

        def __init__(self) -> None:
            self.t0 = self.t1 = self.s0 = 0.0
            self.steps: list[float] = []

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            self.s0 = time.time()
            self.t0 = self.t0 or self.s0

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            self.t1 = time.time()
            self.steps.append(self.t1 - self.s0)

    g = cfg.batch.group_size
    n = cfg.batch.inputs_per_iteration
    out = Path(spec["out"])
    args = GRPOConfig(
        output_dir=str(out / "trainer"), seed=int(spec["seed"]), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=max(1, spec["iterations"] // 10), dataloader_num_workers=0,
        # one optimizer step per generation of n prompts x G completions, prompts in flexmarl's order
        per_device_train_batch_size=n * g, gradient_accumulation_steps=1, num_generations=g,
        steps_per_generation=1, num_iterations=1, max_steps=int(spec["iterations"]), shuffle_dataset=False,
        max_completion_length=sampling.max_new_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, top_k=0,
        # flexmarl's GRPO: (r - mean) / std over the group, Dr. GRPO's constant normaliser
        # (samples x max_new_tokens), PPO clip, no KL term
        loss_type="dr_grpo", scale_rewards="group", beta=algo.kl_coef, epsilon=algo.clip_eps,
        learning_rate=algo.lr, lr_scheduler_type="constant", warmup_steps=algo.lr_warmup_steps,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        weight_decay=algo.weight_decay, max_grad_norm=algo.max_grad_norm,
    )
    data = datasets.Dataset.from_list([
        {"prompt": r["prompt"], "input_id": r["input_id"], "text": r["text"], "answer": r["answer"],
         "meta": json.dumps(r["meta"])} for r in rows])
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[clock])
    trainer.train()
    trainer.model.save_pretrained(str(out / "final"), safe_serialization=True)
    span = clock.t1 - clock.t0
    logs = [x for x in trainer.state.log_history if "reward" in x]
    res = {"tokens": generated[0], "span_s": span, "tokens_per_s": generated[0] / span,
           "steps": len(clock.steps), "step_s": clock.steps,
           "reward": [{"step": x["step"], "reward": x["reward"]} for x in logs],
           "versions": {"trl": trl.__version__, "torch": torch.__version__,
                        "transformers": transformers.__version__, "datasets": datasets.__version__},
           "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    (out / "result.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
