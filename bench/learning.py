"""Learning: does RL on the team add accuracy on top of SFT, and do the synchronous and the
co-design (async) pipelines learn equally well?

For each seed: `flexmarl sft` until the team reaches `train.sft_target_accuracy` on held-out
problems (the "SFT-only" row), then N RL iterations through the Prefect flow from those
checkpoints, once with all co-design switches off (sync) and once with all on (async);
held-out accuracy is greedy team accuracy on the same held-out problems before and after.

    python bench/learning.py --json runs/bench/learning.json [--quick] [--seeds 0 1 2]
    python bench/learning.py --json OUT --sft-from runs/bench-learning   # reuse SFT checkpoints

RL runs at 128 problems per iteration in two micro-batches of 64 (`RL_BATCH`; the default
config's 64 is sized for a short `make run`): over 25 iterations that doubled batch added
+0.016 held-out accuracy on seed 2 (+0.082 -> +0.098), and `--set` can override it.

`--sft-seed S` starts every RL seed from seed S's SFT checkpoints: the RL seed then sets the
training problems, the sampling and the held-out problems, the starting point is shared.

`--sft-from DIR` starts RL from DIR/sft-<seed>/ckpt (what an earlier run of this bench or
`flexmarl sft --out` wrote; one that is missing is made there), so RL settings can be compared
on the same SFT-only starting points. Without it SFT checkpoints live under `--out`, and are
likewise reused when already there.
Held-out accuracy is measured on `--heldout` problems (default 512, ~10 s of greedy decoding):
at the config's 128 one measurement is +-0.04, as large as the effect being measured.

Mode `k1` (`--modes async k1`): the async pipeline with bounded staleness
`codesign.max_staleness=1` and every agent on `decoupled_ppo`, from the same SFT checkpoints
(`acc_k1`; k = 0 is `async`). Nothing else differs: same batch, learning rate and seed. Mode
`late_k1`: that with `codesign.late_binding` too, the simulator's best co-design at scale
(`acc_late_k1`, `diff_late_k1`).

Mode `ppo` (`--modes async ppo`): every trainable agent on `algorithm.advantage: gae` with the
run's critic (`critic.shared` true by default: one value head on a frozen copy of the first
agent's SFT'd model), same batch, learning rate and seed as `async` (GRPO). Adds per seed
`ev_<agent>` (explained variance in the last iteration) and `critic_share` (the critic's
seconds over all trainer ops'); JSON acc_ppo, diff_ppo, gain_ppo, explained_var, critic_share.
`spread` is the standard deviation over seeds of each mode's held-out accuracy.

Mode `lora` (`--modes async lora`): the same team with every agent a LoRA adapter (`LORA_SPEC`:
rank 8, alpha 16, every linear layer; lr `LORA_LR_FACTOR` x the full model's, fixed before
measuring, not tuned) through the same async pipeline from the same SFT checkpoints: each
agent's base is its own SFT'd model (saved as an HF folder, DIR/sft-<seed>/hf/<agent>) and its
adapter starts as PEFT's no-op (lora_B = 0), so the LoRA team starts as exactly the full team's
SFT-only function (`acc_sft_lora` == `acc_sft`) and the comparison isolates RL through adapters
against RL of the whole model. Mode `lora_shared`: the MARFT shape, every agent an adapter on ONE
shared base that its own SFT trained on every agent's demonstrations (`run_sft`, adapters no-ops,
stopping at the same `train.sft_target_accuracy`) into DIR/sft-lora-<seed>/ckpt; its SFT-only
accuracy differs from the full team's (same target, other parameterisation).

JSON: acc_sft, acc_rl (= acc_async), acc_sync, acc_async, acc_k1, acc_lora, acc_sft_lora_shared,
acc_lora_shared (fractions, mean over seeds), diff_k1 / diff_lora / diff_lora_shared (mean over
seeds of acc_<mode> - acc_async, each seed's pair measured on the same held-out problems), seeds,
iterations, heldout, and per-seed rows; team and config; gain (= gain_async, else gain_sync)
and gain_<mode> (mean over seeds of acc_<mode> minus that seed's acc_sft, also in each row);
sync_minus_async per seed run in both modes. `--sync-seeds 0` adds the sync mode on seed 0
only, to check async against sync without paying for it on every seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from flexmarl_core.config import SWITCHES, switch_overrides

REPO = Path(__file__).resolve().parents[1]
#: RL modes scored against their SFT start (`gain_<mode>`), and those also against `async`
#: on the same problems (`diff_<mode>`)
GAINED = ("sync", "async", "k1", "late_k1", "ppo")
COMPARED = ("k1", "late_k1", "lora", "lora_shared", "ppo")

RL_BATCH = ["batch.inputs_per_iteration=128", "batch.micro_batch_inputs=64"]
#: a LoRA agent of `lora` mode: adapters on every linear layer; LoRA usually takes ~10x a full
#: fine-tune's learning rate (docs/lora-staleness.md), chosen before any measurement, not tuned here
LORA_SPEC = "{rank: 8, alpha: 16}"
LORA_LR_FACTOR = 10.0


def lora_team(cfg: object, bases: dict[str, Path] | None = None) -> list[str]:
    """Overrides turning every agent of `cfg` into a LoRA adapter: on `bases[agent]` (an HF
    folder), or all on one shared base of the agent's preset."""
    out = []
    for a in cfg.team.agents:  # type: ignore[attr-defined]
        base = bases[a.name] if bases else a.model.preset
        out += [f"team.agents.{a.name}.model={{base: '{base}', lora: {LORA_SPEC}}}",
                f"team.agents.{a.name}.algorithm.lr={a.algorithm.lr * LORA_LR_FACTOR}"]
    return out


def hf_bases(cfg: object, ckpt: Path) -> dict[str, Path]:
    """Each agent's SFT checkpoint `ckpt/<agent>/model.safetensors` as an HF folder (made once,
    `ckpt/../hf/<agent>`) that `model.base` can name."""
    from safetensors.torch import load_file

    from flexmarl_core.models import load_agent_model
    from flexmarl_core.models.factory import save_model

    out = {}
    for a in cfg.team.agents:  # type: ignore[attr-defined]
        folder = (ckpt.parent / "hf" / a.name).resolve()
        if not (folder / "config.json").is_file():
            model, tok = load_agent_model(a.model, seed=cfg.seed)  # type: ignore[attr-defined]
            model.load_state_dict(load_file(str(ckpt / a.name / "model.safetensors")))
            save_model(model, tok, folder)
        out[a.name] = folder
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="1 seed, fewer iterations, async only")
    ap.add_argument("--config", default=str(REPO / "configs" / "default.yaml"))
    ap.add_argument("--seeds", type=int, nargs="*", default=None)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--modes", nargs="*", default=None, choices=["sync", "async", "k1", "late_k1", "lora", "lora_shared", "ppo"])
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--sft-from", default=None, metavar="DIR",
                    help="SFT checkpoints DIR/sft-<seed>/ckpt (and sft-lora-<seed>): reused, or made there")
    ap.add_argument("--heldout", type=int, default=512,
                    help="held-out problems for the before/after accuracy (workload.heldout_size)")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench-learning"), metavar="DIR",
                    help="run folders go here (default: runs/bench-learning)")
    ap.add_argument("--sync-seeds", type=int, nargs="*", default=[], metavar="SEED",
                    help="also run the sync mode on these seeds (async vs sync on a few seeds)")
    ap.add_argument("--sft-seed", type=int, default=None, metavar="S",
                    help="every RL seed starts from seed S's SFT checkpoints (default: its own)")
    ap.add_argument("--rows-from", default=None, metavar="JSON",
                    help="an earlier JSON of this bench: its per-seed results are kept and the "
                    "modes it has are not run again (resume, or add a mode to a finished run)")
    args = ap.parse_args()
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    iterations = args.iterations or (6 if args.quick else 25)
    run_modes = args.modes or (["async"] if args.quick else ["sync", "async"])

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flexmarl.prefect_api import ensure_api
    from flexmarl_core.config import load_config

    api, _ = ensure_api()
    from flows.train import train

    out_dir = Path(args.out).resolve()
    sft_root = Path(args.sft_from).resolve() if args.sft_from else out_dir
    earlier = {r["seed"]: r for r in json.loads(Path(args.rows_from).read_text())["rows"]} if args.rows_from else {}
    rows: list[dict] = []
    t0 = time.time()
    for seed in seeds:
        base = [f"seed={seed}", f"workload.heldout_size={args.heldout}", *args.set]
        row: dict = dict(earlier.get(seed, {"seed": seed}))
        rows.append(row)
        modes = run_modes + (["sync"] if seed in args.sync_seeds and "sync" not in run_modes else [])
        for mode in modes:
            if f"acc_{mode}" in row:
                print(f"seed {seed} {mode}: kept from {args.rows_from}", flush=True)
                continue
            team = lora_team(load_config(args.config, base)) if mode == "lora_shared" else []
            sft = "sft_lora" if mode == "lora_shared" else "sft"
            sft_seed = seed if args.sft_seed is None else args.sft_seed
            ckpt = sft_root / f"{sft.replace('_', '-')}-{sft_seed}" / "ckpt"
            if f"{sft}_steps" not in row:
                sft_base = [f"seed={sft_seed}", *base[1:]]
                got = sft_checkpoint(args, sft_root, ckpt, [*sft_base, *team])
                row.update({f"{sft}_{k}": v for k, v in got.items()})
            if mode == "lora":  # adapters on the full team's SFT'd models: the same start
                cfg = load_config(args.config, base)
                team = lora_team(cfg, hf_bases(load_config(args.config, [f"seed={sft_seed}", *base[1:]]), ckpt))
            overrides = [*RL_BATCH, *base, *team, f"run_dir={out_dir}/{mode}-{seed}",
                         f"train.iterations={iterations}", f"train.init_from={ckpt}",
                         "train.evaluate_initial=true",
                         *switch_overrides(**{"off" if mode == "sync" else "on": SWITCHES})]
            if mode in ("k1", "late_k1"):
                overrides += ["codesign.late_binding=true"] if mode == "late_k1" else []
                agents = [a.name for a in load_config(args.config, base).team.agents]
                overrides += ["codesign.max_staleness=1",
                              *[f"team.agents.{a}.algorithm.policy_loss=decoupled_ppo" for a in agents]]
            if mode == "ppo":
                trainable = [a.name for a in load_config(args.config, base).team.agents if a.trainable]
                overrides += [f"team.agents.{a}.algorithm.advantage=gae" for a in trainable]
            tr = time.time()
            with temporary_settings(updates={PREFECT_API_URL: api}):
                state = train(args.config, overrides, progress=False, overwrite=True, return_state=True)
            if not state.is_completed():
                print(f"seed {seed} {mode} failed: {state.message}", file=sys.stderr)
                return 1
            s = state.result()["summary"]
            # SFT-only accuracy is measured by the same evaluation on the same problems.
            row["acc_sft_lora_shared" if mode == "lora_shared" else "acc_sft_lora" if mode == "lora"
                else "acc_sft"] = s["initial_heldout_accuracy"]
            row[f"acc_{mode}"] = s["heldout_accuracy"]
            row[f"{mode}_s"] = time.time() - tr
            if mode in GAINED:
                row[f"gain_{mode}"] = row[f"acc_{mode}"] - row["acc_sft"]
            if mode == "ppo":
                row.update(critic_figures(out_dir / f"{mode}-{seed}"))
            print(f"seed {seed} {mode}: SFT-only {s['initial_heldout_accuracy']:.3f} -> RL "
                  f"{row[f'acc_{mode}']:.3f} ({iterations} iterations, {row[f'{mode}_s']:.0f} s)", flush=True)
            for m in COMPARED:
                if f"acc_{m}" in row and "acc_async" in row:
                    row[f"diff_{m}"] = row[f"acc_{m}"] - row["acc_async"]
            # Written after every run: a bench cut short keeps what it measured (--rows-from).
            write_json(args, seeds, iterations, rows, time.time() - t0)
    res = write_json(args, seeds, iterations, rows, time.time() - t0)
    cols = ["acc_sft", "acc_sync", "acc_async", "acc_k1", "acc_late_k1", "acc_lora", "acc_sft_lora_shared", "acc_lora_shared",
            "acc_ppo"]
    nan = float("nan")
    print("\n seed " + " ".join(f"{c[4:]:>8s}" for c in cols))  # sft_lora_shared: its own SFT
    for r in [*rows, {"seed": "mean", **res}]:
        print(f"{r['seed']!s:>5s} " + " ".join(f"{r.get(c) if r.get(c) is not None else nan:8.3f}" for c in cols))
    if res["gain"] is not None:
        print(f"gain over SFT-only: mean {res['gain']:+.3f} (per seed "
              + ", ".join(f"{r.get('gain_async', r.get('gain_sync', nan)):+.3f}" for r in rows) + ")")
    for k in (f"diff_{m}" for m in COMPARED):
        if res[k] is not None:
            per = ", ".join(f"{r[k]:+.3f}" for r in rows if k in r)
            print(f"{k}: mean {res[k]:+.3f} (per seed {per})")
    return 0


def critic_figures(run_dir: Path) -> dict[str, float]:
    """A gae run's critic at the end: each agent's explained variance in the last iteration
    (`ev_<agent>`), and the critic's share of the trainer ops' seconds (`critic_share`: its
    value, train, step and sync ops over every agent's and critic's)."""
    rows = [json.loads(x) for x in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines() if x.strip()]
    out = {f"ev_{k.split('/')[1]}": v for k, v in rows[-1].items() if k.endswith("/explained_var")}
    ops = [json.loads(x) for x in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines() if x.strip()]
    trainer = [o for o in ops if o["kind"] in ("train", "step", "sync", "value")]
    critic = sum(o["t_end"] - o["t_start"] for o in trainer if o["agent"].startswith("critic"))
    out["critic_share"] = critic / max(sum(o["t_end"] - o["t_start"] for o in trainer), 1e-9)
    return out


def write_json(args: argparse.Namespace, seeds: list[int], iterations: int, rows: list[dict],
               wall_s: float) -> dict:
    def mean(key: str) -> float | None:
        vals = [r[key] for r in rows if key in r]
        return statistics.fmean(vals) if vals else None

    from flexmarl_core.config import load_config

    res = {"config": args.config, "team": load_config(args.config, []).name, "seeds": seeds, "iterations": iterations, "heldout": args.heldout, "overrides": args.set,
           "acc_sft": mean("acc_sft"), "acc_sync": mean("acc_sync"), "acc_async": mean("acc_async"),
           "acc_k1": mean("acc_k1"), "acc_late_k1": mean("acc_late_k1"), "diff_late_k1": mean("diff_late_k1"),
           "acc_sft_lora": mean("acc_sft_lora"), "acc_lora": mean("acc_lora"),
           "acc_sft_lora_shared": mean("acc_sft_lora_shared"), "acc_lora_shared": mean("acc_lora_shared"),
           "diff_k1": mean("diff_k1"), "diff_lora": mean("diff_lora"), "diff_lora_shared": mean("diff_lora_shared"),
           "acc_ppo": mean("acc_ppo"), "diff_ppo": mean("diff_ppo"), "critic_share": mean("critic_share"),
           "explained_var": {k[3:]: mean(k) for k in sorted({k for r in rows for k in r if k.startswith("ev_")})},
           "spread": {m: statistics.stdev(v) if len(v) > 1 else 0.0 for m in ("sft", *GAINED)
                      if (v := [r[f"acc_{m}"] for r in rows if f"acc_{m}" in r])},
           "bench_wall_s": wall_s, "rows": rows}
    res["acc_rl"] = res["acc_async"] if res["acc_async"] is not None else res["acc_sync"]
    # Mean over seeds of each seed's own gain (RL minus its SFT start), per mode.
    for mode in GAINED:
        res[f"gain_{mode}"] = mean(f"gain_{mode}")
    res["gain"] = res["gain_async"] if res["gain_async"] is not None else res["gain_sync"]
    # The co-design's samples equal sync's and its weights agree within 1e-4 per step; over
    # many iterations one flipped sampled token lets the runs drift apart, so this is a
    # difference to read against the held-out noise, not a bit-equality check.
    res["sync_minus_async"] = {r["seed"]: r["acc_sync"] - r["acc_async"]
                               for r in rows if "acc_async" in r and "acc_sync" in r}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    return res


def sft_checkpoint(args: argparse.Namespace, root: Path, ckpt: Path, overrides: list[str]) -> dict:
    """The SFT checkpoint at `ckpt`: reused when it is complete (`sft.json`), else made there.
    Its steps and the seconds SFT took here."""
    from flexmarl_core.config import load_config
    from flexmarl_core.driver.sft import run_sft

    meta = ckpt / "sft.json"
    if meta.is_file():
        return {"steps": json.loads(meta.read_text())["steps"], "s": 0.0, "from": str(ckpt)}
    cfg = load_config(args.config, [*overrides, f"run_dir={root}/{ckpt.parent.name}"])
    ts = time.time()
    sft = run_sft(cfg, out_dir=ckpt, log=lambda m: print(m, flush=True))
    return {"steps": sft["steps"], "s": time.time() - ts}


if __name__ == "__main__":
    sys.exit(main())
