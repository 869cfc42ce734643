"""A team written as a program against the same team in YAML, on the same work.

    python bench/program.py --json OUT [--quick] [--repeats N] [--iterations N] [--set K=V ...]

Runs `configs/default.yaml` (the planner -> solver -> verifier team as a YAML graph) and
`configs/program_team.yaml` (the same agents, batch, workload and cluster, the team as
`examples/programs/arith_team.py` calling its agents through flexmarl's OpenAI-compatible
endpoint) through the training flow `flexmarl train` runs, alternately, from the same starting
weights (the YAML team's SFT warm start, made on first use and cached). Medians over repeats:

- `tokens_per_s_yaml`, `tokens_per_s_program` and `tokens_per_s_ratio` (program / YAML): sampled
  tokens per second of the whole iteration (rollout and training), the figure the issue's
  target (>= 0.8) is about; `tokens_per_s_ratio_per_repeat` pairs the runs of one repeat;
- `util_yaml`, `util_program`: the workers' busy share (a program op's own span is not busy
  time; its decodes on the agents' instances are);
- `e2e_s_per_iteration_yaml`, `e2e_s_per_iteration_program`;
- `call_overhead_ms_p50`, `call_overhead_ms_p99`: a call's client-side time beyond waiting
  for and running its decode (HTTP, JSON, templating, tokenising), median over program ops;
- `requests_per_decode`: how many concurrent calls one decode batch served (a YAML rollout op
  decodes its micro-batch's 256 prompts at once: the program's calls batch up to that);
- `client_cpu_ms_per_call`, `endpoint_cpu_ms_per_call`: CPU one chat call costs beyond its
  decode, in a stock `openai` client and in the endpoint, measured one call at a time
  (`programs.report.call_cpu_ms`); `calls_per_iteration`; `yaml_cpu_s_per_iteration` (the YAML
  run's op CPU); and `tokens_per_s_ratio_bound` = yaml CPU / (yaml CPU + calls x per-call CPU):
  the ratio a program team could reach on this machine if its calls cost only that on top of
  the YAML team's work, at equal utilisation. With tiny models a call's decode costs about as
  much as its HTTP round trip, so this bound, not the endpoint, caps the ratio; it approaches 1
  as decoding grows (bigger models, longer answers: `--set` a longer `max_new_tokens`).

`--quick`: 1 repeat of 2 iterations. The load average around each run is in `load`.

`--decode-bound`: the same pair where decoding dominates: every agent `tiny-10m`, answers of
`DECODE_BOUND_TOKENS` new tokens with no stop string, both teams from the same untrained
weights (no warm start: what is measured is speed, not accuracy), both on two workers that
serve every agent (`SHARED_INSTANCES`: a program op's micro-batch decodes on its own worker;
with one dedicated instance per agent the two micro-batches' ops would queue on the same
instance in step, `--set cluster.workers=...` to measure that). Its `tokens_per_s_ratio` is
the figure for real model sizes (target >= 0.9). With `--quick`, 32 problems per iteration in
two micro-batches of 16.

`--tools-from DIR`: also run `configs/program_react.yaml`'s ReAct calculator agent, as written
against the stock `openai` client (`examples/programs/calculator_openai.py`: LangChain's own
HTTP client would bypass the timing of flexmarl's), from the checkpoints in DIR (e.g. its SFT
warm start) and report its calls' `tool_call_overhead_ms_p50` / `_p99` (the same client-side
overhead, for calls that carry tools and tool results) and `tool_calls_per_trajectory`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from flexmarl.prefect_api import ensure_api
from flexmarl_core.config import load_config
from flexmarl_core.driver.sft import warm_start
from flexmarl_core.models.tokenizer import default_cache_dir
from flexmarl_core.programs.report import call_cpu_ms, program_figures
from flexmarl_core.programs.team import program_team
from flexmarl_core.workloads import make_workload

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"yaml": REPO / "configs" / "default.yaml", "program": REPO / "configs" / "program_team.yaml"}
#: `--decode-bound`: new tokens per answer (every agent, no stop string)
DECODE_BOUND_TOKENS = 96


#: `--decode-bound`: both teams on two workers that serve every agent (plain `rollout` tags)
SHARED_INSTANCES = ("cluster.workers=[{name: w0, resources: {rollout: 1, train: 1}}, "
                    "{name: w1, resources: {rollout: 1, train: 1}}]")


def decode_bound_overrides() -> list[str]:
    agents = [a.name for a in load_config(CONFIGS["yaml"]).team.agents]
    return [*(f"team.agents.{a}.{k}" for a in agents for k in (
        "model.preset=tiny-10m", f"sampling.max_new_tokens={DECODE_BOUND_TOKENS}", "sampling.stop=[]")),
        SHARED_INSTANCES]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="1 repeat of 2 iterations")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], help="config overrides for both teams")
    ap.add_argument("--init-from", default=None, metavar="DIR",
                    help="start both teams from these checkpoints (default: the YAML team's SFT warm start)")
    ap.add_argument("--decode-bound", action="store_true",
                    help=f"every agent tiny-10m with {DECODE_BOUND_TOKENS}-token answers, from untrained weights")
    ap.add_argument("--tools-from", default=None, metavar="DIR",
                    help="also run configs/program_react.yaml from these checkpoints (tool-call overhead)")
    args = ap.parse_args()
    if args.decode_bound:
        # --quick: a quarter of the batch (a 96-token iteration of 128 problems takes ~10 min here)
        quick = ["batch.inputs_per_iteration=32", "batch.micro_batch_inputs=16"] if args.quick else []
        args.set = [*decode_bound_overrides(), "train.warm_start=none", *quick, *args.set]
    repeats = args.repeats or (1 if args.quick else 3)
    iterations = args.iterations or (2 if args.quick else 4)

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.train import train

    api, _ = ensure_api()
    start: Path | None = Path(args.init_from) if args.init_from else None
    if start is None and not args.decode_bound:
        start = warm_start(load_config(CONFIGS["yaml"], args.set), default_cache_dir(), log=print)[0]
    init = [f"train.init_from={start}"] if start is not None else []
    out_dir = REPO / "runs" / "bench-program"
    runs: dict[str, list[dict]] = {m: [] for m in CONFIGS}
    t0 = time.time()
    with temporary_settings(updates={PREFECT_API_URL: api}):
        for rep in range(repeats):
            for mode in (list(CONFIGS) if rep % 2 == 0 else list(CONFIGS)[::-1]):
                run_dir = out_dir / f"{mode}-{rep}"
                load = os.getloadavg()[0]
                state = train(str(CONFIGS[mode]), [f"run_dir={run_dir}", f"train.iterations={iterations}",
                                                   *init, "train.evaluate=false",
                                                   "train.evaluate_initial=false", *args.set],
                              progress=False, overwrite=True, return_state=True)
                if not state.is_completed():
                    print(f"{mode} rep {rep} failed: {state.message}", file=sys.stderr)
                    return 1
                s = state.result()["summary"]
                ops = [json.loads(x) for x in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines() if x.strip()]
                cpu = sum(o.get("cpu_s", 0.0) for o in ops) / iterations
                runs[mode].append({**s, **program_figures(ops), "op_cpu_s_per_iteration": cpu,
                                   "load": [load, os.getloadavg()[0]]})
                print(f"{mode:8s} rep {rep}: {s['e2e_s_per_iteration']:.2f} s/it, {s['tokens_per_s']:.0f} tok/s, "
                      f"util {s['utilization']:.2f}", flush=True)
        tools = _tool_calls(train, Path(args.tools_from), out_dir, iterations) if args.tools_from else {}
    med = lambda mode, key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
    prog = runs["program"]
    pcfg = load_config(CONFIGS["program"], args.set)
    problem = make_workload(pcfg.workload, pcfg.team).problems("train", 1, seed=0)[0].text
    cost = call_cpu_ms(program_team(pcfg.team, pcfg.seed), f"Q:{problem}\nP:")
    per_traj = statistics.median(sum(r["calls_per_trajectory"].values()) for r in prog)
    calls = per_traj * pcfg.batch.inputs_per_iteration * pcfg.batch.group_size
    yaml_cpu = med("yaml", "op_cpu_s_per_iteration")
    res = {
        "repeats": repeats, "iterations": iterations, "start": str(start), "overrides": args.set,
        "tokens_per_s_yaml": med("yaml", "tokens_per_s"), "tokens_per_s_program": med("program", "tokens_per_s"),
        "tokens_per_s_ratio_per_repeat": [p["tokens_per_s"] / y["tokens_per_s"] for p, y in zip(prog, runs["yaml"], strict=True)],
        "util_yaml": med("yaml", "utilization"), "util_program": med("program", "utilization"),
        "e2e_s_per_iteration_yaml": med("yaml", "e2e_s_per_iteration"),
        "e2e_s_per_iteration_program": med("program", "e2e_s_per_iteration"),
        "call_overhead_ms_p50": statistics.median(r["call_overhead_ms_p50"] for r in prog),
        "call_overhead_ms_p99": statistics.median(r["call_overhead_ms_p99"] for r in prog),
        "server_overhead_ms_p50": statistics.median(r["server_overhead_ms_p50"] for r in prog),
        "requests_per_decode": statistics.median(r["requests_per_decode"] for r in prog),
        "client_cpu_ms_per_call": cost["client"], "endpoint_cpu_ms_per_call": cost["endpoint"],
        "calls_per_iteration": calls, "yaml_cpu_s_per_iteration": yaml_cpu,
        "tokens_per_s_ratio_bound": yaml_cpu / (yaml_cpu + calls * (cost["client"] + cost["endpoint"]) / 1e3),
        "decode_bound": args.decode_bound, **tools,
        "bench_wall_s": time.time() - t0, "runs": runs,
    }
    res["tokens_per_s_ratio"] = res["tokens_per_s_program"] / res["tokens_per_s_yaml"]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    print(f"\n{'':22s}{'YAML':>10s}{'program':>10s}")
    for key in ("tokens_per_s", "util", "e2e_s_per_iteration"):
        print(f"{key:22s}{res[key + '_yaml']:10.3f}{res[key + '_program']:10.3f}")
    target = 0.9 if args.decode_bound else 0.8
    print(f"tokens_per_s_ratio {res['tokens_per_s_ratio']:.3f} (target >= {target}); call overhead p50 "
          f"{res['call_overhead_ms_p50']:.1f} ms, p99 {res['call_overhead_ms_p99']:.1f} ms; "
          f"{res['requests_per_decode']:.1f} requests per decode")
    print(f"per call beyond its decode: client {res['client_cpu_ms_per_call']:.2f} ms + endpoint "
          f"{res['endpoint_cpu_ms_per_call']:.2f} ms CPU, {calls:.0f} calls per iteration against "
          f"{yaml_cpu:.1f} CPU-s of YAML work: ratio bound {res['tokens_per_s_ratio_bound']:.3f}")
    if tools:
        print(f"tool-calling program (ReAct): call overhead p50 {tools['tool_call_overhead_ms_p50']:.1f} ms, "
              f"p99 {tools['tool_call_overhead_ms_p99']:.1f} ms, {tools['tool_calls_per_trajectory']:.2f} calls "
              "per trajectory")
    return 0


def _tool_calls(train: Any, start: Path, out_dir: Path, iterations: int) -> dict[str, float]:
    """`configs/program_react.yaml` from `start` for `iterations`: its calls' overhead."""
    run_dir = out_dir / "react"
    state = train(str(REPO / "configs" / "program_react.yaml"),
                  [f"run_dir={run_dir}", f"train.iterations={iterations}", f"train.init_from={start}",
                   "team.program=examples/programs/calculator_openai.py:team",  # timed by flexmarl's client
                   "train.evaluate=false", "train.evaluate_initial=false"], progress=False, overwrite=True, return_state=True)
    if not state.is_completed():
        raise RuntimeError(f"program_react failed: {state.message}")
    ops = [json.loads(x) for x in (run_dir / "metrics" / "ops.jsonl").read_text().splitlines() if x.strip()]
    fig = program_figures(ops)
    return {"tool_call_overhead_ms_p50": fig["call_overhead_ms_p50"],
            "tool_call_overhead_ms_p99": fig["call_overhead_ms_p99"],
            "tool_calls_per_trajectory": sum(fig["calls_per_trajectory"].values())}


if __name__ == "__main__":
    sys.exit(main())
