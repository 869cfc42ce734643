"""SFT warm start: each agent's starting checkpoint from the workload's demonstrations.

Tiny models built from scratch know nothing, so GRPO would see all-zero reward groups. SFT on
teacher-forced demonstrations (each agent's ideal output given its parents' ideal outputs,
sometimes a plausible mistake upstream so downstream agents see real errors) gives RL a signal.
It stops as soon as the team's greedy held-out accuracy reaches `train.sft_target_accuracy`,
which is the paper's "SFT-only" starting point; RL must then add to it.

    flexmarl sft configs/default.yaml        # writes <run_dir>-sft/<agent>/model.safetensors
    flexmarl train configs/default.yaml --set train.init_from=runs/arith-team-sft
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from flexmarl_core.algorithms import token_weight
from flexmarl_core.config import ExperimentConfig
from flexmarl_core.config.layout import torch_threads_on_free_cores
from flexmarl_core.driver.evaluate import evaluate_team
from flexmarl_core.inference import make_inference_engine
from flexmarl_core.inference.tools import split_demonstration, tool_of
from flexmarl_core.models import load_agent_model
from flexmarl_core.models.lora import base_key
from flexmarl_core.models.tokenizer import tokenizer_key
from flexmarl_core.runfiles.weights import initial_weights, save_state_atomic
from flexmarl_core.teams import team_shape
from flexmarl_core.training import Sample, make_trainer
from flexmarl_core.training.api import TokenBatch, TrainBackend
from flexmarl_core.training.handles import StateFileError, dump, load, trim_buffers
from flexmarl_core.workloads import make_workload
from storage.atomic import atomic_folder, atomic_path


def sft_loss(logprobs: torch.Tensor, batch: TokenBatch) -> tuple[torch.Tensor, Mapping[str, Any]]:
    """Negative log-likelihood of the demonstration tokens, summed (the trainer normalises)."""
    nll = -(logprobs * batch.mask).sum()
    return nll, {"nll": nll.detach()}


def demonstration_tokens(tok: Any, text: str, tool: Any) -> tuple[list[int], list[int] | None]:
    """A demonstration's token ids and loss mask, as a rollout would hold them: each tool
    output tokenized on its own and masked (`inference/tools.py`); no tool: one piece, no mask."""
    if tool is None:
        return tok(text, add_special_tokens=False)["input_ids"], None
    ids: list[int] = []
    mask: list[int] = []
    for piece, sampled in split_demonstration(text, tool):
        p = tok(piece, add_special_tokens=False)["input_ids"]
        ids += p
        mask += [int(sampled)] * len(p)
    return ids, mask


def _warn_cut(cfg: ExperimentConfig, demos: dict[str, list[tuple[Any, str]]], toks: dict[str, Any],
              log: Callable[[str], None]) -> None:
    """A demonstration longer than the agent's `max_new_tokens` teaches answers its samples
    can never finish (a tool call cut mid-JSON never parses): said once, at the first step."""
    for agent, pairs in demos.items():
        cap = cfg.agent(agent).sampling.max_new_tokens
        longest = max((len(toks[agent].encode(t, add_special_tokens=False)) + 1 for _, t in pairs), default=0)
        if longest > cap:
            log(f"warning: agent {agent!r}'s demonstrations take up to {longest} tokens with their end, "
                f"more than team.agents.{agent}.sampling.max_new_tokens={cap}: answers like them are cut")


def run_sft(
    cfg: ExperimentConfig,
    out_dir: str | Path | None = None,
    *,
    log: Callable[[str], None] = print,
    keep_checks: bool = False,
    resume_from: str | Path | None = None,
) -> dict[str, Any]:
    """Train every trainable agent on demonstrations until the team reaches the target.

    `keep_checks`: also save the team at every evaluation as `<out>/step-<N>` (a checkpoint
    folder like `<out>` itself, with its `sft.json`), so a start below the target or before the
    plateau can be picked afterwards without training again.

    `resume_from`: continue from a saved team (an `<out>` or `<out>/step-<N>` folder): its
    weights, its step count from its `sft.json`, and its `sft_state.flx` (each trainer's state:
    Adam moments, step counter, RNG; the demonstration sampler's RNG), so the run goes on bit
    for bit as the uninterrupted one would. A folder saved before that file existed resumes
    with a fresh optimizer and the sampler reseeded, and says so; a damaged or mismatched one
    raises `ResumeStateError` naming it."""
    with torch_threads_on_free_cores(lambda why: log(f"sft: {why}")):
        return _run_sft(cfg, out_dir, log=log, keep_checks=keep_checks, resume_from=resume_from)


def _run_sft(
    cfg: ExperimentConfig,
    out_dir: str | Path | None,
    *,
    log: Callable[[str], None],
    keep_checks: bool,
    resume_from: str | Path | None,
) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    team = team_shape(cfg)
    meg = team.meg
    workload = make_workload(cfg.workload, cfg.team)
    # Beside the run folder, not in it: a fresh run replaces its run folder.
    out = Path(out_dir) if out_dir else Path(f"{cfg.resolved_run_dir()}-sft")
    tc = cfg.train
    models, engines, trainers, toks = {}, {}, {}, {}
    refresh: list[str] = []  # agents whose engine holds a copy of the trained weights
    # LoRA agents on one base SFT that base together (one model, one trainer, every agent's
    # demonstrations in each step); RL then trains each one's adapter on it.
    # Read first: a folder that is not a saved team fails before any model is built.
    src = Path(resume_from) if resume_from is not None else None
    resumed_at, acc, saved = _saved_meta(src) if src is not None else (None, 0.0, None)
    by_base: dict[str, str] = {}  # base key -> the first agent on it (owns model and trainer)
    for agent in meg.agent_names:
        acfg = cfg.agent(agent)
        key = base_key(acfg.model, cfg.seed) if acfg.model.lora is not None else None
        owner = by_base.setdefault(key, agent) if key is not None else agent
        if owner != agent:
            models[agent], toks[agent] = models[owner], toks[owner]
            if acfg.trainable and owner in trainers:
                trainers[agent] = trainers[owner]
            engines[agent] = engines[owner]  # same weights; prompts make the role
            continue
        model, tok = load_agent_model(acfg.model, seed=cfg.seed)
        if resume_from is not None:  # before the trainer copies anything from the module
            model.load_state_dict(initial_weights(str(resume_from), agent))
        models[agent], toks[agent] = model, tok
        if acfg.trainable:
            # One process (training_dp=1): the engine below must share the trained module.
            chunk = {"train_chunk_tokens": tc.sft_chunk_tokens} if tc.sft_chunk_tokens else {}
            sft_cfg = acfg.model_copy(update={
                "algorithm": acfg.algorithm.model_copy(update={"lr": tc.sft_lr, "lr_warmup_steps": 0}),
                "backend": acfg.backend.model_copy(update={"training_dp": 1, **chunk}),
            })
            trainers[agent] = make_trainer(sft_cfg, model, loss_fn=sft_loss, loss_weight_fn=token_weight)
        # The engine shares the trainer's module (evaluation sees the latest weights for free)
        # unless it would cast it: the trainer's fp32 master weights must stay fp32, so a
        # bf16 engine gets a copy and is refreshed before each evaluation.
        shared = not acfg.trainable or (acfg.model.dtype == "float32" and acfg.backend.inference == "hf")
        engines[agent] = make_inference_engine(acfg, model if shared else copy.deepcopy(model), tok)
        if not shared:
            refresh.append(agent)
    heldout = workload.problems("heldout", min(cfg.workload.heldout_size, tc.sft_eval_size), seed=cfg.seed)
    rng = random.Random(cfg.seed)
    step, t0 = resumed_at or 0, time.time()
    history = []
    if src is not None:
        # Last, after everything built above has drawn from torch's RNG.
        if saved is not None:
            _load_state(src / STATE_NAME, saved, _owners(trainers), rng)
            saved = None
            trim_buffers()  # the file's read buffer would otherwise stay pooled for the whole run
        else:
            log(f"sft resume: {src / STATE_NAME} not found (saved before SFT kept its "
                "optimizer state): the optimizer starts fresh and the demonstration sampler is reseeded, "
                "so this run differs from an uninterrupted one")
        history.append({"step": step, "accuracy": acc, "time_s": 0.0, "resumed_from": str(resume_from)})
        log(f"sft resumed from {resume_from} at step {step} (held-out accuracy {acc:.3f})")
    while True:
        if step == resumed_at:  # its check was made when it was saved
            if acc >= tc.sft_target_accuracy or step >= tc.sft_max_steps:
                break
        elif step % tc.sft_eval_every == 0:
            for agent in refresh:
                engines[agent].update_weights(trainers[agent].weights(), step)
            acc = evaluate_team(team, workload, engines, heldout, seed=cfg.seed,
                                batch=tc.eval_batch)["accuracy"]
            history.append({"step": step, "accuracy": acc, "time_s": time.time() - t0})
            log(f"sft step {step}: held-out accuracy {acc:.3f}")
            if keep_checks:
                _save_team(out / f"step-{step}", meg.agent_names, models, _owners(trainers), rng,
                           {"accuracy": acc, "steps": step, "target": tc.sft_target_accuracy})
            if acc >= tc.sft_target_accuracy or step >= tc.sft_max_steps:
                break
        problems = workload.problems("train", tc.sft_batch, seed=cfg.seed + 1, offset=step * tc.sft_batch)
        demos = team.demonstrations(workload, problems, seed=cfg.seed + step, rng=rng, perturb=tc.sft_perturb)
        if step == (resumed_at or 0):
            _warn_cut(cfg, demos, toks, log)
        for agent, tr in trainers.items():
            tok = toks[agent]
            acfg = cfg.agent(agent)
            # what ends the answer: its stop string, or in a chat template's turns the EOS
            stop = (acfg.sampling.stop or [""])[0] or (
                tok.eos_token if acfg.chat_template != "plain" else "")
            tool = tool_of(workload, agent)
            batch = []
            for prompt, target in demos[agent]:
                resp, mask = demonstration_tokens(tok, target + stop, tool)
                ids = prompt if isinstance(prompt, list) else tok(prompt, add_special_tokens=False)["input_ids"]
                batch.append(Sample(prompt_ids=ids,
                                    response_ids=resp, logprobs=[0.0] * len(resp), advantage=0.0,
                                    loss_mask=mask))
            tr.accumulate(batch, loss_scale=1.0 / max(token_weight(batch), 1.0))
        for tr in {id(t): t for t in trainers.values()}.values():  # a shared base steps once
            tr.step()
        step += 1
    result = {"out_dir": str(out), "accuracy": acc, "steps": step, "history": history,
              "target": tc.sft_target_accuracy}
    _save_team(out, meg.agent_names, models, _owners(trainers), rng, result)
    return result


#: each saved team's trainer and sampler state (a `training.handles` state file: plain data)
STATE_NAME = "sft_state.flx"
_STATE_FORMAT = 1


class ResumeStateError(ValueError):
    """A saved SFT state that cannot be resumed from; the message names its file."""


def _saved_meta(src: Path) -> tuple[int, float, dict[str, Any] | None]:
    """Step count, accuracy and state (None: saved before SFT kept one) of a team `run_sft`
    saved, from its `sft.json` and `sft_state.flx`: read before any model is built, so a bad
    folder fails at once."""
    meta_path = src / "sft.json"
    if not meta_path.exists():
        raise ResumeStateError(f"sft resume: {meta_path} not found (not a folder `flexmarl sft` saved)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResumeStateError(f"sft resume: {meta_path} cannot be read as JSON: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("steps"), int):
        raise ResumeStateError(f"sft resume: {meta_path} has no integer field 'steps'")
    digest = meta.get("state_sha256")
    if digest is None:
        return meta["steps"], float(meta.get("accuracy", 0.0)), None
    path = src / STATE_NAME
    try:
        with open(path, "rb") as f:
            # sft.json is written last, with the digest: a damaged file, or one from a save that
            # did not finish, fails here instead of resuming from weights and moments that disagree.
            if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                raise ResumeStateError(f"sft resume: {path} is damaged or not the one {meta_path} "
                                       "records (its sha256 differs)")
            f.seek(0)
            state = load(f, what=str(path))
    except FileNotFoundError:
        raise ResumeStateError(f"sft resume: {path} not found, but {meta_path} records it") from None
    except StateFileError as e:
        raise ResumeStateError(f"sft resume: {e}") from e
    if state.get("format") != _STATE_FORMAT:
        raise ResumeStateError(f"sft resume: {path} has format {state.get('format')!r}, expected {_STATE_FORMAT}")
    return meta["steps"], float(meta.get("accuracy", 0.0)), state


def _owners(trainers: Mapping[str, TrainBackend]) -> dict[str, TrainBackend]:
    """Each trainer once, under the first agent that has it (LoRA agents share their base's)."""
    seen: dict[int, str] = {}
    for agent, tr in trainers.items():
        seen.setdefault(id(tr), agent)
    return {agent: trainers[agent] for agent in seen.values()}


def _save_team(out: Path, agents: list[str], models: dict[str, torch.nn.Module],
               trainers: Mapping[str, TrainBackend], rng: random.Random, meta: dict[str, Any]) -> None:
    """Every file atomically, the state first and `sft.json` (with the state's digest) last:
    a crash part way leaves a folder whose `sft.json` does not match its state, which a resume
    refuses, never a mix it would load."""
    state = {
        "format": _STATE_FORMAT,
        # copy=False: written out before anything steps again
        "trainers": {agent: tr.state(copy=False) for agent, tr in trainers.items()},
        "python_rng": rng.getstate(),  # which demonstrations are perturbed
        "torch_rng": torch.get_rng_state(),  # dropout
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }
    with atomic_path(out / STATE_NAME) as tmp:
        with open(tmp, "w+b") as f:
            dump(state, f)
            f.seek(0)
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    for agent in agents:
        _save(out / agent, models[agent])
    with atomic_path(out / "sft.json") as tmp:
        tmp.write_text(json.dumps({"out_dir": str(out), **meta, "state_sha256": digest}, indent=2))


def _load_state(path: Path, state: Mapping[str, Any], trainers: Mapping[str, TrainBackend],
                rng: random.Random) -> None:
    """`_save_team`'s state (read from `path`) into the trainers, the sampler and torch's RNGs."""
    if set(state["trainers"]) != set(trainers):
        raise ResumeStateError(f"sft resume: {path} holds trainers {sorted(state['trainers'])}, "
                               f"this config trains {sorted(trainers)}")
    try:
        for agent, tr in trainers.items():
            tr.load_state(state["trainers"][agent])
        rng.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ResumeStateError(f"sft resume: {path} does not fit this config: {e}") from e


def _save(path: Path, model: torch.nn.Module) -> None:
    save_state_atomic(path / "model.safetensors", model.state_dict())


#: bump when SFT itself changes what it produces for the same config
WARM_START_VERSION = 2  # 2: the key holds only what SFT reads


def _file_stamp(path: str | None, cache_dir: Path | None = None) -> list[Any] | None:
    """Size and modification time of a file or folder's files the config points at (a model
    folder, a dataset): an edited file must not reuse checkpoints made from the old one. A file
    inside `cache_dir` is named relative to it, so a cache moved whole (`cp -a`, `rsync -a`: the
    times travel) keeps its warm starts."""
    if not path:
        return None
    p = Path(os.path.expanduser(path))
    files = sorted(p.rglob("*")) if p.is_dir() else [p]
    return [[_in_cache(str(f), cache_dir), (st := f.stat()).st_size, st.st_mtime_ns] for f in files if f.is_file()]


def _in_cache(path: str, cache_dir: Path | None) -> str:
    """`path` with the cache folder's own prefix replaced by `<cache>` (unchanged outside it)."""
    p = Path(os.path.expanduser(path))
    if cache_dir is None or not p.exists():  # not a file here: a hub id stays as it is
        return path
    try:
        return "<cache>/" + p.resolve().relative_to(cache_dir).as_posix()
    except ValueError:
        return path


def warm_start_key(cfg: ExperimentConfig, cache_dir: str | Path | None = None) -> str:
    """What SFT's result depends on: the team minus RL's own fields (`_team_key`), the workload
    (and the files both point at), the tokenizer recipe, the seed and the SFT settings; not RL's
    loss, learning rate, batch, switches (`max_staleness` included), cluster or iterations, so
    runs that differ only there share a warm start. Paths inside `cache_dir` (a model an
    earlier warm start made, a dataset) are keyed relative to it."""
    wl = cfg.workload
    cache = Path(cache_dir).resolve() if cache_dir is not None else None
    team, workload = _team_key(cfg), wl.model_dump(mode="json")
    # `base`: a LoRA agent's, a preset name or a folder
    for fields, name in [*((a["model"], f) for a in team["agents"] for f in ("path", "base")),
                         (workload, "path"), (workload["params"], "heldout_path")]:
        if fields.get(name):
            fields[name] = _in_cache(fields[name], cache)
    parts = {
        "version": WARM_START_VERSION, "tokenizer": tokenizer_key(),
        "team": team, "workload": workload,
        "files": [_file_stamp(a.model.path, cache) for a in cfg.team.agents]
        + [_file_stamp(wl.path, cache), _file_stamp(wl.params.get("heldout_path"), cache)],
        "seed": cfg.seed,
        "sft": _sft_key(cfg),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _sft_key(cfg: ExperimentConfig) -> dict[str, Any]:
    """The SFT settings (`train.sft_*`); `eval_batch` is not one: it only regroups the greedy
    decoding, which gives the same outputs (tests/unit/test_workloads_longtail.py)."""
    return {k: v for k, v in cfg.train.model_dump(mode="json").items() if k.startswith("sft_")}


#: agent fields `run_sft` never reads: RL's loss and its knobs (SFT has its own loss, and a KL
#: reference would only be scored, never used), RL's learning rate and warm-up (SFT steps at
#: `train.sft_lr`), data-parallel ranks (SFT trains in one process) and `top_p` (SFT evaluates
#: greedily). Everything else an agent declares reaches SFT: model, template, edges, rounds,
#: temperature (the trainer scores logprobs at it), stop strings and max_new_tokens (the
#: demonstrations and the evaluation), weight decay, clipping, bf16 and the backends.
_RL_ONLY = {
    "algorithm": ("advantage", "policy_loss", "clip_eps", "is_cap", "kl_coef", "lr", "lr_warmup_steps",
                  "skip_zero_advantage"),
    "backend": ("training_dp",),
    "sampling": ("top_p",),
}


def _team_key(cfg: ExperimentConfig) -> dict[str, Any]:
    """The team as SFT reads it: every field but `_RL_ONLY`, and an agent's
    `train_chunk_tokens` only while `train.sft_chunk_tokens` does not replace it."""
    team = cfg.team.model_dump(mode="json")
    for a in team["agents"]:
        for section, fields in _RL_ONLY.items():
            for f in fields:
                a[section].pop(f)
        if cfg.train.sft_chunk_tokens is not None:
            a["backend"].pop("train_chunk_tokens")
    return team


def warm_start_path(cfg: ExperimentConfig, cache_dir: str | Path) -> Path:
    """Where `cfg`'s warm start is cached (complete once it holds `sft.json`)."""
    return Path(cache_dir) / "warm-start" / warm_start_key(cfg, cache_dir)


def warm_start(cfg: ExperimentConfig, cache_dir: str | Path, *, log: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """SFT checkpoints of `cfg`'s team: made on first use, then reused from `cache_dir`.

    Returns the checkpoint folder (one `<agent>/model.safetensors` each, like `flexmarl sft`)
    and its `sft.json` (held-out accuracy, steps, and `reused`). Made in a temporary folder and
    renamed into place, so a crash never leaves a half-written cache entry."""
    final = warm_start_path(cfg, cache_dir)
    reused = (final / "sft.json").exists()
    if not reused:
        with atomic_folder(final) as tmp:  # a run that made the same entry meanwhile keeps its own
            run_sft(cfg, out_dir=tmp, log=log)
    info = json.loads((final / "sft.json").read_text())
    return final, {**info, "out_dir": str(final), "reused": reused}
