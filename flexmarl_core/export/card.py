"""The model card (`README.md`) of an exported agent: what it is in its team, where it came from
(run, config, commit, version), how it did (the run's held-out figures and the training figures
of the iteration that made it) and how to load it."""

from __future__ import annotations

import json
from typing import Any

import yaml

from flexmarl_core.config import AgentConfig
from flexmarl_core.driver.metrics import log_lines
from flexmarl_core.export.versions import TrainedRun
from flexmarl_core.runfiles import provenance


def _role(run: TrainedRun, agent: AgentConfig) -> list[str]:
    team = run.cfg.team
    lines = [f"- team shape: {team.shape}; the team's agents: {', '.join(a.name for a in team.agents)}"]
    if team.program is not None:
        lines.append(f"- the program `{team.program}` calls it as `model={agent.name!r}`")
    froms = [e.src + (" (previous round)" if e.recurrent else "") for e in team.edges if e.dst == agent.name]
    tos = [e.dst for e in team.edges if e.src == agent.name]
    if agent.template is not None:
        lines.append(f"- prompt template: `{json.dumps(agent.template)}`, reading "
                     f"{', '.join(['the problem', *froms]) if froms else 'the problem'}")
    if tos:
        lines.append(f"- its answer goes into the prompt of: {', '.join(tos)}")
    sinks = [a.name for a in team.agents if not any(e.src == a.name for e in team.edges)]
    output = team.output or (sinks[0] if len(sinks) == 1 else team.agents[-1].name)
    if output == agent.name and team.shape != "environment":
        lines.append("- it gives the team's answer (the output agent)")
    if agent.system is not None:
        lines.append(f"- system message: `{json.dumps(agent.system)}`")
    lines.append(f"- chat template: `{agent.chat_template if len(agent.chat_template) < 40 else 'custom Jinja'}` "
                 "(the tokenizer's `chat_template` here)")
    if not agent.trainable:
        lines.append("- frozen in this run: these are its initial weights")
    return lines


def _training(run: TrainedRun, version: int) -> dict[str, Any]:
    """The metrics row of the iteration whose step made `version` (iteration version - 1)."""
    try:
        rows = [json.loads(x) for x in log_lines(run.loc, "iterations.jsonl") if x.strip()]
    except (OSError, ValueError):
        return {}
    return next((r for r in rows if r.get("iteration") == version - 1), {})


def model_card(run: TrainedRun, agent: AgentConfig, version: int, *, kind: str, base_name: str | None,
               load: str) -> str:
    """The card's markdown. `kind`: what the folder holds (full weights, a LoRA adapter merged,
    or an adapter on `base_name`); `load`: the Python that loads it."""
    cfg, prov = run.cfg, provenance.read(run.loc)
    m = agent.model
    source = m.hub_id or m.path or f"the built-in preset {m.preset} (seed {cfg.seed})"
    front = {"library_name": "peft" if kind == "adapter" else "transformers", "pipeline_tag": "text-generation",
             "tags": ["flexmarl", "reinforcement-learning", "multi-agent"]}
    if m.hub_id:
        front["base_model"] = m.hub_id
    commit = prov.get("commit")
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {cfg.name}: {agent.name}, weights version {version}", "",
             f"The `{agent.name}` agent of the flexmarl team `{cfg.name}`, after {version} optimizer "
             f"step(s) of RL ({'the final version' if version == cfg.train.iterations else 'an intermediate version'} "
             f"of a run of {cfg.train.iterations} iterations). {kind}.", "",
             "## Role in the team", "", *_role(run, agent), "",
             "## Provenance", "",
             f"- run: `{run.where}`, weights `weights/{agent.name}/v{version}.safetensors`",
             f"- model: {source}" + (f" at revision `{m.revision}`" if m.revision else "")
             + (f"; LoRA rank {m.lora.rank}, alpha {m.lora.alpha} on {', '.join(m.lora.target_modules)}"
                if m.lora else ""),
             f"- flexmarl {prov.get('flexmarl') or '(version not recorded)'}, commit "
             + (f"`{commit}`" + (" (with uncommitted changes)" if prov.get("dirty") else "") if commit
                else "not recorded (a run prepared before flexmarl recorded it, or not from a git checkout)"),
             f"- seed {cfg.seed}; workload {cfg.workload.kind}; advantage {agent.algorithm.advantage}, "
             f"lr {agent.algorithm.lr:g}; the run's whole config is `config.yaml` beside this folder"]
    if base_name is not None:
        lines.append(f"- base model of this adapter: `{base_name}`")
    held, trained = run.heldout(version), _training(run, version)
    lines += ["", "## Figures", ""]
    if held:
        rewards = ", ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in held.items() if k.startswith("heldout_reward/"))
        lines.append(f"- the team's held-out accuracy with these weights: {held['heldout_accuracy']:.3f} on "
                     f"{held.get('heldout_n', '?')} problems ({held.get('heldout_set', 'the workload held-out set')}); "
                     f"mean reward per agent: {rewards or 'n/a'}")
    else:
        lines.append("- the run measured no held-out accuracy for this version: "
                     f"`flexmarl eval {run.where} --version {version}` does")
    if trained:
        own = trained.get(f"agent/{agent.name}/reward")
        lines.append(f"- iteration {version - 1} (the one whose step made it), on its training problems: team "
                     f"accuracy {trained.get('accuracy', float('nan')):.3f}"
                     + (f", this agent's mean reward {own:.3f}" if isinstance(own, int | float) else ""))
    s = agent.sampling
    lines += ["", "## Use", "",
              f"Sampled in training at temperature {s.temperature:g}, top-p {s.top_p:g}, at most "
              f"{s.max_new_tokens} new tokens" + (f", stopping at {json.dumps(s.stop)}" if s.stop else "")
              + ": `generation_config.json` holds these (`stop_strings` needs `tokenizer=` in `generate`)."
              + (" Its answers were constrained to a JSON schema (`sampling.json_schema`), which a plain "
                 "`generate` does not enforce." if s.json_schema else ""), "",
              "```python", load, "```", ""]
    return "\n".join(lines)
