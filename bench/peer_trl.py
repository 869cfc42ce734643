"""Against a peer: TRL's `GRPOTrainer` and flexmarl on the same single-agent GRPO work, side by
side, in wall time and tokens per second, with held-out accuracy before and after.

    python bench/peer_trl.py --json OUT [--quick] [--seeds 0 1 2] [--iterations 500]
        [--workloads short long] [--background 0 1] [--api fresh|ambient]

What is the same on both sides:

- **Model and start.** The config's tiny preset (`configs/overhead.yaml`: tiny-1m, 1.1M
  parameters), SFT'd once per workload by flexmarl's own SFT: the warm start `flexmarl train`
  makes (`driver/sft.py` `warm_start`: `run_sft` until `train.sft_target_accuracy`, cached
  under $FLEXMARL_CACHE/warm-start), seed `--sft-seed`. The long workload's SFT starts from
  the short one's result (its model is that start as an HF folder), so it only has to carry
  it over to the long prompt. flexmarl starts from it with `train.init_from`; TRL from the
  same weights saved as an HF folder (`save_pretrained`), whose generation config also ends a
  completion at the token of the agent's stop string (`\\n`), which is how flexmarl's engine ends
  it (a stop string, checked while decoding).
- **Data.** Iteration i's prompts are the workload's train problems `i*n .. i*n+n-1` for the
  run's seed (what `driver/run.py` `prepare_run` writes to the store), rendered by flexmarl
  (`teams/graph.py` `prompt`) and given to TRL in that order (`shuffle_dataset=False`); the TRL
  process checks its tokenizer gives flexmarl's prompt ids.
- **Reward.** The workload's own `reward` (0.9 x correct + 0.1 x well-formed), imported from
  the checkout in the TRL process, on the completion's text cut at the stop string.
- **Settings.** n = 8 prompts x G = 8 completions = 64 per step, one optimizer step per
  generation (`num_iterations=1`), lr 1e-4 constant, AdamW (0.9, 0.999), no weight decay, grad
  clip 1.0, at most 8 new tokens, temperature 0.5, top-p 1, no top-k, fp32, no KL term, PPO
  clip 0.2, advantages (r - group mean) / group std, the Dr. GRPO loss normaliser
  (samples x max new tokens: TRL's `loss_type="dr_grpo"`), the machine's cores: flexmarl's
  auto layout, TRL's torch threads (OMP/MKL threads and `torch.set_num_threads` in its process).
- **Evaluation.** One evaluator for every model: flexmarl's greedy held-out evaluation
  (`driver/evaluate.py` `evaluate_team` on the HF engine, `--heldout` problems of the run's
  seed), run by this process on the SFT start, on flexmarl's final weights and on TRL's, so
  neither side's wall time holds an evaluation.

Workloads: `short`, the arithmetic one of `bench/single_agent.py` (a + b and a - b below 50,
prompts of about 10 tokens, answers of 2 to 3 tokens with the stop); `long`, the same problems
behind a fixed few-shot prompt of about 300 tokens (train-split problems with their answers,
`LONG_PROMPT_TOKENS`), where padding, packing and prefix sharing matter.

How it is measured: for every (workload, seed, background) one TRL run and one flexmarl run,
the order of the two alternating from one pair to the next. **flexmarl** runs the Prefect flow
`flexmarl train` runs (`flows/train.py` `train`) with the config's cluster (a local Dask
cluster laid out from the machine, `cluster.workers: auto`: one worker of 2 torch threads on
2 cores) and its default co-design settings;
the Prefect API is a server of the bench's own with a new database (`--api fresh`, warmed by
an unmeasured 3-iteration run, as `bench/overhead.py` does), or the one `flexmarl train` would
use (`--api ambient`). **TRL** (`bench/_trl_grpo.py`) runs in a process of its own, with the
python of a venv this bench makes once under `--venv` (default `.cache/peer-trl-venv`:
`trl==TRL_VERSION` with this venv's exact torch and transformers; elsewhere the CPU torch wheel
may need `--pip-arg=--extra-index-url=https://download.pytorch.org/whl/cpu`). TRL 1.16 also
resolves beside flexmarl's pins, but would add datasets and pandas to every flexmarl install.
TRL's torch threads are the machine's cores (`machine_cores`: what flexmarl's layout lays
out on a quiet machine), or `--trl-threads N`. Beside a busy core flexmarl's auto layout leaves
that core out (`flexmarl_core/config/layout.py`); `--trl-threads 1` gives TRL the same.

`--overlap` adds a third side to every pair, `overlap`: flexmarl with `OVERLAP` (bounded
staleness 1 and `decoupled_ppo`), so the agent's next rollout runs beside its training; the
auto layout then gives it two workers of one thread on 2 cores. The three sides take turns
going first. Per pair `ratio_overlap` (its tokens/s over TRL's) and `overlap_gain` (over the
on-policy flexmarl side's); the summary has their means and `acc_after_overlap`.

Per side: `tokens_per_s` (completion tokens, stop token included, over the training loop's
span: flexmarl's run summary, the iterations' windows from the first op to the last; TRL's
first step start to last step end), `span_s`, `wall_s` (the whole side: flow call, or TRL
process from start to exit, imports and model loading included), `step_s` (each step's
seconds: TRL's steps, flexmarl's iteration windows) and its median `step_s_median`, `reward`
(the train reward, mean over tenths of the run), `machine_busy` (the share of all the
machine's cores busy while it ran, /proc/stat), `server_cpu_s` (the Prefect server's CPU in
that time) and `settle_s` (how long the bench waited before the side for the server to go
idle, so that what it still does for a flow run that ended never lands on the next side),
`acc_after`, and the 1-minute load average sampled every 2 s while it ran. Per pair:
`ratio` = flexmarl's tokens/s over TRL's, `wall_ratio` = TRL's wall over flexmarl's,
`acc_sft`. Summary per workload and background: means over seeds, `ratio` the mean of the
pairs' ratios, `diff_acc` flexmarl minus TRL.

`--background N`: each side runs beside N processes spinning a pure-Python loop at nice
`--background-nice` (default 0: each asks for a whole core), started just before the side and
stopped after it, outside the bench's process tree (as another program's work: the auto layout
counts the run's own processes as its own); several values run every pair under each. 0 is a
quiet machine only if nothing else runs: the load columns say what the machine did.

What differs and could not be made equal: the sampling RNG streams (same seed, different
generators: the completions differ); flexmarl decodes with its own batched sampler over a KV
cache (`inference/hf.py`), TRL with `model.generate`; flexmarl stops at any token whose text
holds the stop string, TRL at the stop's own token; TRL adds 1e-4 to the group std where
flexmarl adds 1e-6 (advantages differ by at most 0.3% at these rewards);
flexmarl scores the clip ratio against the engine's behaviour log-probs, TRL against the
trainer's own (both on-policy: the ratio is 1 up to rounding); flexmarl's span starts with its
first op, which loads the model in the worker, TRL's after its model is loaded; and flexmarl's
side includes what it is (a flow process, a Dask scheduler and worker, the Prefect API)
where TRL is one process.

`--quick`: one seed, 30 iterations per workload, 256 held-out problems: about 3 minutes once
the SFT starts and the TRL venv exist; the first run makes them (the long workload's SFT took
about 1,150 steps, most of an hour on a busy 2-core machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _fresh import LoadSampler, drain_prefect, machine
from single_agent import WORKLOAD

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "overhead.yaml"
TRL_VERSION = "1.16.0"
#: the long workload's prompt: few-shot examples up to about this many tokens
LONG_PROMPT_TOKENS = 300
#: seed of the few-shot examples' draw: one fixed prompt for every seed
SHOTS_SEED = 999
WARMUP_ITERATIONS = 3
#: the `overlap` side: flexmarl with its next rollout beside its training (bounded staleness 1,
#: the off-policy loss that corrects it); `cluster.workers: auto` lays the machine out for it
OVERLAP = ["codesign.max_staleness=1", "team.agents.0.algorithm.policy_loss=decoupled_ppo"]


def trl_python(venv: Path, pip_args: list[str]) -> Path:
    """The TRL venv's python: made once (`python -m venv`, then TRL pinned with this venv's
    torch and transformers), reused while its stamp matches those pins."""
    import torch
    import transformers

    pins = [f"trl=={TRL_VERSION}", f"torch=={torch.__version__}", f"transformers=={transformers.__version__}",
            "pydantic>=2.7,<3", "pyyaml>=6"]
    py, stamp = venv / "bin" / "python", venv / ".peer-trl-stamp"
    if py.exists() and stamp.is_file() and stamp.read_text() == json.dumps(pins):
        return py
    print(f"making the TRL venv in {venv}: {' '.join(pins)}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", *pip_args, *pins], check=True)
    stamp.write_text(json.dumps(pins))
    return py


def workload_config(name: str, out: Path, short_start: tuple[Path, dict] | None = None) -> Path:
    """The config file of a workload: the overhead config, or for `long` a copy of it whose
    template puts the few-shot examples before the question and whose model is the short
    workload's SFT start (`short_start`: its folder and weights, saved once as an HF folder
    under $FLEXMARL_CACHE/peer-trl named by that folder's key: the long warm start's key stamps
    the folder's files, so it must stay put), so its SFT only carries that start over to the
    long prompt."""
    if name == "short":
        return CONFIG
    import yaml

    from flexmarl_core.config import load_config
    from flexmarl_core.models.factory import save_model
    from flexmarl_core.models.tokenizer import get_tokenizer
    from flexmarl_core.runfiles.location import default_cache_dir
    from flexmarl_core.workloads import make_workload
    from storage.atomic import atomic_folder

    cfg = load_config(str(CONFIG), WORKLOAD)
    tok = get_tokenizer()
    shots, k = "", 0
    wl = make_workload(cfg.workload, cfg.team)
    while len(tok.encode(shots + "Q:", add_special_tokens=False)) < LONG_PROMPT_TOKENS - 8:
        p = wl.problems("train", 1, seed=SHOTS_SEED, offset=k)[0]
        shots, k = shots + f"Q:{p.text}\nA:{p.answer}\n", k + 1
    raw = yaml.safe_load(CONFIG.read_text())
    raw["name"] = "peer-long"
    raw["team"]["agents"][0]["template"] = shots + "Q:{input}\nA:"
    if short_start is not None:
        model_dir = default_cache_dir() / "peer-trl" / f"sft-hf-{short_start[0].name}"
        if not (model_dir / "config.json").is_file():
            with atomic_folder(model_dir) as tmp:  # another bench never sees half a folder
                save_model(*base_model(cfg, short_start[1]), tmp)  # type: ignore[arg-type]
        raw["team"]["agents"][0]["model"] = {"path": str(model_dir)}
    path = out / "peer-long.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def sft_start(config: Path, base: list[str]) -> tuple[Path, dict]:
    """flexmarl's SFT start for `config`: the warm start `flexmarl train` makes
    (`driver/sft.py` `warm_start`, `run_sft` until `train.sft_target_accuracy`), cached by a key
    of everything SFT reads, so a changed workload or template never reuses a stale one."""
    from flexmarl_core.config import load_config
    from flexmarl_core.driver.sft import warm_start
    from flexmarl_core.runfiles.location import default_cache_dir

    return warm_start(load_config(str(config), base), default_cache_dir(), log=lambda m: print(m, flush=True))


def prompt_tokens(cfg: object) -> float:
    """Mean prompt tokens of the first iteration's prompts."""
    from flexmarl_core.meg import MEG
    from flexmarl_core.models.tokenizer import get_tokenizer
    from flexmarl_core.teams.graph import prompt
    from flexmarl_core.workloads import make_workload

    tok, meg = get_tokenizer(), MEG.from_config(cfg.team)  # type: ignore[attr-defined]
    wl, name = make_workload(cfg.workload, cfg.team), cfg.team.agents[0].name  # type: ignore[attr-defined]
    ps = wl.problems("train", cfg.batch.inputs_per_iteration, seed=cfg.seed)  # type: ignore[attr-defined]
    return statistics.fmean(len(tok.encode(prompt(meg, name, p.text, {}), add_special_tokens=False)) for p in ps)


def base_model(cfg: object, state: dict | None = None) -> tuple[object, object]:
    """The agent's model (its preset, or its folder), fp32, with `state` loaded, and its tokenizer."""
    from flexmarl_core.models import load_agent_model

    model, tok = load_agent_model(cfg.team.agents[0].model, seed=cfg.seed)  # type: ignore[attr-defined]
    if state is not None:
        model.load_state_dict(state)
    return model, tok


def heldout_accuracy(cfg: object, state: dict) -> float:
    """Greedy held-out accuracy of the agent with weights `state`: flexmarl's evaluation."""
    from flexmarl_core.driver.evaluate import evaluate_team
    from flexmarl_core.inference import make_inference_engine
    from flexmarl_core.teams import team_shape
    from flexmarl_core.workloads import make_workload

    agent = cfg.team.agents[0]  # type: ignore[attr-defined]
    model, tok = base_model(cfg, state)
    wl = make_workload(cfg.workload, cfg.team)  # type: ignore[attr-defined]
    problems = wl.problems("heldout", cfg.workload.heldout_size, seed=cfg.seed)  # type: ignore[attr-defined]
    res = evaluate_team(team_shape(cfg), wl, {agent.name: make_inference_engine(agent, model, tok)}, problems,
                        seed=cfg.seed, batch=cfg.train.eval_batch)  # type: ignore[attr-defined]
    return float(res["accuracy"])


def trl_inputs(cfg: object, sft_state: dict, iterations: int, folder: Path) -> tuple[Path, Path]:
    """The SFT start as an HF folder TRL loads (ending completions at the stop's token too),
    and the prompts of every iteration, in flexmarl's order."""
    from flexmarl_core.meg import MEG
    from flexmarl_core.teams.graph import prompt
    from flexmarl_core.workloads import make_workload

    agent = cfg.team.agents[0]  # type: ignore[attr-defined]
    model, tok = base_model(cfg, sft_state)
    stops = [t for s in agent.sampling.stop for t in tok.encode(s, add_special_tokens=False)]
    model.generation_config.eos_token_id = [tok.eos_token_id, *stops]  # type: ignore[attr-defined]
    model_dir = folder / "sft-hf"
    model.save_pretrained(str(model_dir), safe_serialization=True)  # type: ignore[attr-defined]
    tok.save_pretrained(str(model_dir))  # type: ignore[attr-defined]
    meg, wl = MEG.from_config(cfg.team), make_workload(cfg.workload, cfg.team)  # type: ignore[attr-defined]
    n = cfg.batch.inputs_per_iteration  # type: ignore[attr-defined]
    rows = []
    for it in range(iterations):
        for p in wl.problems("train", n, seed=cfg.seed, offset=it * n):  # type: ignore[attr-defined]
            text = prompt(meg, agent.name, p.text, {})
            rows.append({"prompt": text, "prompt_ids": tok.encode(text, add_special_tokens=False),
                         "input_id": p.input_id, "text": p.text, "answer": p.answer, "meta": p.meta})
    data = folder / "prompts.json"
    data.write_text(json.dumps(rows))
    return model_dir, data


def run_trl(py: Path, config: Path, overrides: list[str], cfg: object, sft_state: dict,
            iterations: int, folder: Path, threads_given: int | None = None) -> tuple[dict, dict]:
    """TRL's run in its own process: its figures and its final weights. `threads_given`: its
    torch threads (default: the machine's cores, what flexmarl's layout lays out)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    model_dir, data = trl_inputs(cfg, sft_state, iterations, folder)
    from flexmarl_core.config.layout import machine_cores

    # the whole machine, as flexmarl's layout has it on a quiet machine: TRL is one process
    threads = str(threads_given or machine_cores())
    spec = {"repo": str(REPO), "config": str(config), "overrides": overrides, "model": str(model_dir),
            "data": str(data), "iterations": iterations, "threads": threads, "seed": cfg.seed,  # type: ignore[attr-defined]
            "out": str(folder)}
    (folder / "spec.json").write_text(json.dumps(spec, indent=2))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    t0 = time.time()
    with open(folder / "trl.log", "w") as log:
        rc = subprocess.run([str(py), str(REPO / "bench" / "_trl_grpo.py"), str(folder / "spec.json")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=folder).returncode
    wall = time.time() - t0
    if rc != 0:
        tail = (folder / "trl.log").read_text().splitlines()[-30:]
        raise RuntimeError(f"the TRL run failed (exit {rc}; {folder / 'trl.log'}):\n" + "\n".join(tail))
    res = json.loads((folder / "result.json").read_text())
    final = AutoModelForCausalLM.from_pretrained(str(folder / "final"), dtype=torch.float32)
    return {**res, "wall_s": wall, "step_s_median": statistics.median(res["step_s"])}, final.state_dict()


def run_flexmarl(train: object, api: str, config: Path, overrides: list[str], run_dir: Path,
                 iterations: int) -> tuple[dict, dict]:
    """flexmarl's run through the Prefect flow: its figures and its final weights."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flexmarl_core.config import load_config
    from flexmarl_core.runfiles.weights import load_weights

    agent = load_config(str(config), overrides).team.agents[0].name
    t0 = time.time()
    with temporary_settings(updates={PREFECT_API_URL: api}):
        state = train(str(config), overrides, progress=False, overwrite=True, return_state=True)  # type: ignore[operator]
    wall = time.time() - t0
    if not state.is_completed():
        raise RuntimeError(f"the flexmarl run in {run_dir} failed: {state.message}")
    s = state.result()["summary"]
    its = [json.loads(x) for x in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines() if x.strip()]
    res = {"tokens": int(sum(m["tokens"] for m in its)), "span_s": sum(m["e2e_s"] for m in its),
           "tokens_per_s": s["tokens_per_s"], "steps": len(its), "wall_s": wall, "run_wall_s": s["wall_s"],
           "stage_cpu_s": s.get("stage_cpu_s"),
           "step_s_median": statistics.median(m["e2e_s"] for m in its), "step_s": [m["e2e_s"] for m in its],
           # the train reward's mean over windows of iterations, as TRL logs it
           "reward": [{"step": i + w, "reward": statistics.fmean(m[f"agent/{agent}/reward"] for m in its[i:i + w])}
                      for w in [max(1, len(its) // 10)] for i in range(0, len(its) - w + 1, w)]}
    return res, load_weights(str(run_dir), agent, iterations)


def cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine so far (/proc/stat)."""
    f = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)


def server_cpu_s(home: Path | None) -> float | None:
    """CPU seconds so far of the Prefect server flexmarl started with its files in `home`
    (default PREFECT_HOME), children included; None where there is none to measure."""
    import psutil

    from flexmarl.servers import read_pid_file

    home = home or Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    try:
        proc = psutil.Process(int((read_pid_file(home) or {})["pid"]))
        return sum(t.user + t.system for t in (p.cpu_times() for p in [proc, *proc.children(recursive=True)]))
    except (KeyError, ValueError, psutil.Error):
        return None


def settle(home: Path | None, limit_s: float = 60.0) -> float:
    """Wait until the Prefect server is idle (under 5% of a core over a second), at most
    `limit_s`: what it still does for a flow run that ended (events, logs) must not land on the
    next side. Seconds waited."""
    t0, last = time.time(), server_cpu_s(home)
    while last is not None and time.time() - t0 < limit_s:
        time.sleep(1.0)
        now = server_cpu_s(home)
        if now is None or now - last < 0.05:
            break
        last = now
    return time.time() - t0


#: starts the command in argv and prints its pid: the spinner outlives it, so its parent is
#: then init and not the bench (see `background`)
_LAUNCH = ("import subprocess, sys; D = subprocess.DEVNULL; "
           "print(subprocess.Popen(sys.argv[1:], stdin=D, stdout=D, stderr=D).pid)")


@contextlib.contextmanager
def background(n: int, nice: int) -> Iterator[None]:
    """`n` processes spinning a pure-Python loop at `nice` while the block runs. They are not
    the bench's children: the auto layout takes the run's own processes (its descendants) for
    its own work, never for a busy core, and another program's load is what this stands for."""
    from flexmarl_core.config.layout import look_again

    spin = ["nice", "-n", str(nice), sys.executable, "-c", "while True: pass"]
    pids: list[int] = []
    try:
        for _ in range(n):  # each one noted as it starts: a launch that fails stops those before it
            pids.append(int(subprocess.run([sys.executable, "-c", _LAUNCH, *spin], capture_output=True,
                                           text=True, check=True).stdout))
        look_again()  # the pair's config loaded just before, on the machine without them
        yield
    finally:
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for pid in filter(_spinning, pids):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while any(map(_spinning, pids)) and time.monotonic() < deadline:
                time.sleep(0.05)


def _spinning(pid: int) -> bool:
    """Whether `pid` is still one of `background`'s spinners (not a zombie its new parent has not
    reaped, nor another process that got its pid since)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" and b"while True: pass" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False


def provenance() -> dict:
    import torch
    import transformers

    git = ["git", "-C", str(REPO)]
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    return {"commit": sha, "dirty": dirty, "machine": machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": TRL_VERSION}


def summarise(pairs: list[dict]) -> dict:
    out: dict = {}
    for p in pairs:
        out.setdefault(p["workload"], {}).setdefault(str(p["background"]), []).append(p)
    mean = statistics.fmean
    return {w: {bg: {"seeds": [p["seed"] for p in ps], "acc_sft": mean(p["acc_sft"] for p in ps),
                     **{f"{k}_{side}": mean(p[side][k] for p in ps) for side in ("trl", "flexmarl")
                        for k in ("tokens_per_s", "wall_s", "span_s", "acc_after")},
                     "ratio": mean(p["ratio"] for p in ps), "wall_ratio": mean(p["wall_ratio"] for p in ps),
                     "diff_acc": mean(p["flexmarl"]["acc_after"] - p["trl"]["acc_after"] for p in ps),
                     "load_mean": mean(p[s]["load"]["mean"] for p in ps for s in ("trl", "flexmarl")),
                     **({"ratio_overlap": mean(p["ratio_overlap"] for p in ps),
                         "overlap_gain": mean(p["overlap_gain"] for p in ps),
                         **{f"{k}_overlap": mean(p["overlap"][k] for p in ps)
                            for k in ("tokens_per_s", "wall_s", "span_s", "acc_after")},
                         "diff_acc_overlap": mean(p["overlap"]["acc_after"] - p["trl"]["acc_after"] for p in ps)}
                        if all("overlap" in p for p in ps) else {})}
                for bg, ps in by_bg.items()} for w, by_bg in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="1 seed, 30 iterations, 256 held-out problems")
    ap.add_argument("--seeds", type=int, nargs="*", default=None)
    ap.add_argument("--iterations", type=int, default=None, help="per run (default 500, --quick 30)")
    ap.add_argument("--workloads", nargs="*", default=["short", "long"], choices=["short", "long"])
    ap.add_argument("--heldout", type=int, default=None, help="held-out problems (default 512, --quick 256)")
    ap.add_argument("--sft-seed", type=int, default=0, help="the seed of the one SFT start per workload")
    ap.add_argument("--background", type=int, nargs="*", default=[0], metavar="N",
                    help="spinning processes beside each side; several values: every pair under each")
    ap.add_argument("--background-nice", type=int, default=0)
    ap.add_argument("--trl-threads", type=int, default=None,
                    help="TRL's torch threads (default: the machine's cores)")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides (flexmarl and TRL alike)")
    ap.add_argument("--api", default="fresh", choices=["fresh", "ambient"])
    ap.add_argument("--overlap", action="store_true",
                    help="a third side: flexmarl with generation beside training (OVERLAP), on its auto layout")
    ap.add_argument("--venv", default=str(REPO / ".cache" / "peer-trl-venv"), help="the TRL venv (made if missing)")
    ap.add_argument("--pip-arg", action="append", default=[], help="extra pip argument for the TRL venv")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench-peer-trl"), metavar="DIR")
    args = ap.parse_args()
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    iterations = args.iterations or (30 if args.quick else 500)
    heldout = args.heldout or (256 if args.quick else 512)
    out = Path(args.out).resolve()
    py = trl_python(Path(args.venv).resolve(), args.pip_arg)

    import torch

    from flexmarl.prefect_api import ensure_api, start_server, stop_server
    from flexmarl_core.config import load_config
    from flexmarl_core.runfiles.weights import initial_weights

    with contextlib.ExitStack() as stack:
        home: Path | None = None  # the server's PREFECT_HOME (None: the environment's)
        if args.api == "fresh":
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flexmarl-bench-prefect-")))
            stack.callback(stop_server, home)
            stack.callback(drain_prefect)  # before the server stops
            api = start_server(home)
        else:
            api, _ = ensure_api()
        from flows.train import train

        res: dict = {"bench": "peer_trl", "quick": args.quick, "iterations": iterations, "seeds": seeds,
                     "heldout": heldout, "sft_seed": args.sft_seed, "background": args.background,
                     "background_nice": args.background_nice, "api": args.api, "overrides": args.set,
                     "overlap_overrides": OVERLAP if args.overlap else None,
                     "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                     "start_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "load_before": Path("/proc/loadavg").read_text().split()[:3],
                     **provenance(), "workloads": {}, "pairs": []}
        t_bench = time.time()
        starts: dict[str, tuple[Path, Path, dict]] = {}
        # every SFT start first, the pairs then run back to back; `long` starts from `short`'s
        for wname in sorted({"short", *args.workloads}, key=["short", "long"].index):
            config = workload_config(wname, out, starts["short"][1:] if wname == "long" else None)
            ckpt, sft = sft_start(config, [f"seed={args.sft_seed}", *WORKLOAD, *args.set])
            cfg0 = load_config(str(config), [*WORKLOAD, *args.set])
            starts[wname] = (config, ckpt, initial_weights(str(ckpt), cfg0.team.agents[0].name))
            sft = {k: sft[k] for k in ("out_dir", "accuracy", "steps", "target", "reused")}
            res["workloads"][wname] = {"config": str(config), "overrides": [*WORKLOAD, *args.set], "sft": sft,
                                       "prompt_tokens_mean": prompt_tokens(cfg0),
                                       "group_size": cfg0.batch.group_size,
                                       "completions_per_step": cfg0.batch.group_size * cfg0.batch.inputs_per_iteration}
        if args.api == "fresh":  # a new server's first flow run costs it more: not measured
            config, ckpt, _ = starts[args.workloads[0]]
            run_flexmarl(train, api, config, [*WORKLOAD, *args.set, f"run_dir={out}/warmup", f"train.init_from={ckpt}",
                                              f"train.iterations={WARMUP_ITERATIONS}", "train.evaluate=false"],
                         out / "warmup", WARMUP_ITERATIONS)
        k = 0
        for wname in args.workloads:
            config, ckpt, sft_state = starts[wname]
            common = [f"workload.heldout_size={heldout}", *WORKLOAD, *args.set]
            for seed in seeds:
                for bg in args.background:
                    base = [f"seed={seed}", *common]
                    cfg = load_config(str(config), base)
                    torch.set_num_threads(cfg.cluster.torch_threads)
                    pair: dict = {"workload": wname, "seed": seed, "background": bg,
                                  "acc_sft": heldout_accuracy(cfg, sft_state)}
                    sides = ["trl", "flexmarl", *(["overlap"] if args.overlap else [])]
                    # each side first in turn from one pair to the next
                    order = sides[k % len(sides):] + sides[:k % len(sides)]
                    pair["order"], k = order, k + 1
                    tag = f"{wname}-s{seed}-bg{bg}"
                    for side in order:
                        sampler, waited = LoadSampler(every=2.0), settle(home)
                        with background(bg, args.background_nice):
                            sampler.start()
                            srv0, (busy0, total0) = server_cpu_s(home), cpu_busy()
                            if side == "trl":
                                figures, state = run_trl(py, config, base, cfg, sft_state, iterations,
                                                         out / f"{tag}-trl", args.trl_threads)
                            else:
                                run_dir = out / f"{tag}-{side}"
                                figures, state = run_flexmarl(train, api, config, [
                                    *base, *(OVERLAP if side == "overlap" else []),
                                    f"run_dir={run_dir}", f"train.iterations={iterations}",
                                    f"train.init_from={ckpt}", "train.evaluate=false",
                                    f"train.checkpoint_every={iterations}"], run_dir, iterations)
                            figures["load"] = sampler.stop()
                            srv1, (busy1, total1) = server_cpu_s(home), cpu_busy()
                        figures.update(settle_s=waited, machine_busy=(busy1 - busy0) / max(total1 - total0, 1.0),
                                       server_cpu_s=None if srv0 is None or srv1 is None else srv1 - srv0)
                        figures["acc_after"] = heldout_accuracy(cfg, state)
                        pair[side] = figures
                        print(f"{tag} {side}: {figures['tokens_per_s']:.0f} tokens/s over {figures['span_s']:.1f} s "
                              f"(wall {figures['wall_s']:.1f} s), held-out {pair['acc_sft']:.3f} -> "
                              f"{figures['acc_after']:.3f}, load {figures['load']['mean']}", flush=True)
                    pair["ratio"] = pair["flexmarl"]["tokens_per_s"] / pair["trl"]["tokens_per_s"]
                    pair["wall_ratio"] = pair["trl"]["wall_s"] / pair["flexmarl"]["wall_s"]
                    if args.overlap:
                        pair["ratio_overlap"] = pair["overlap"]["tokens_per_s"] / pair["trl"]["tokens_per_s"]
                        pair["overlap_gain"] = pair["overlap"]["tokens_per_s"] / pair["flexmarl"]["tokens_per_s"]
                    res["pairs"].append(pair)
                    res["summary"], res["bench_wall_s"] = summarise(res["pairs"]), time.time() - t_bench
                    res["load"] = {"mean": round(statistics.fmean(
                        p[s]["load"]["mean"] for p in res["pairs"] for s in p["order"]), 2)}
                    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.json).write_text(json.dumps(res, indent=2))  # after every pair: a cut run keeps them
    print(f"\n{'workload':>8s} {'bg':>3s} {'seed':>4s} {'first':>8s} | {'TRL tok/s':>9s} {'wall':>6s} {'acc':>6s} | "
          f"{'flexmarl tok/s':>14s} {'wall':>6s} {'acc':>6s} | {'ratio':>5s} {'sft':>6s} {'load':>5s}")
    for p in res["pairs"]:
        t, f = p["trl"], p["flexmarl"]
        print(f"{p['workload']:>8s} {p['background']:>3d} {p['seed']:>4d} {p['order'][0]:>8s} | "
              f"{t['tokens_per_s']:9.0f} {t['wall_s']:6.1f} {t['acc_after']:6.3f} | {f['tokens_per_s']:14.0f} "
              f"{f['wall_s']:6.1f} {f['acc_after']:6.3f} | {p['ratio']:5.2f} {p['acc_sft']:6.3f} "
              f"{statistics.fmean([t['load']['mean'], f['load']['mean']]):5.1f}")
    for w, by_bg in res["summary"].items():
        for bg, s in by_bg.items():
            print(f"{w}, background {bg}: flexmarl/TRL tokens/s {s['ratio']:.2f}x, wall {s['wall_ratio']:.2f}x, "
                  f"held-out {s['acc_sft']:.3f} -> TRL {s['acc_after_trl']:.3f}, flexmarl {s['acc_after_flexmarl']:.3f} "
                  f"(diff {s['diff_acc']:+.3f}), load {s['load_mean']:.1f}")
            if "ratio_overlap" in s:
                print(f"{w}, background {bg}: overlap/TRL tokens/s {s['ratio_overlap']:.2f}x, overlap/flexmarl "
                      f"{s['overlap_gain']:.2f}x, held-out {s['acc_after_overlap']:.3f} (diff {s['diff_acc_overlap']:+.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
