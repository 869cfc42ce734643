"""Can the ReAct calculator agent see the problem's operator? Per checkpoint, the probability
it gives `+`, `-` and `*` where its calculator call writes the operator, by the operator the
problem holds, and how alike the three symbols' input embeddings are.

The first tool-call turn of `n` held-out problems is teacher-forced up to the operator
(`{"expression": "47` then the operator): a model that reads the operator puts its mass on the
problem's; one that does not gives every problem the same three numbers.

    python bench/react_operator.py --ckpt runs/x/sft-0/ckpt runs/y/sft-0/ckpt --json OUT
    python bench/react_operator.py --set workload.params.phrasing=symbols --ckpt DIR --json OUT
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

OPS = ("+", "-", "*")
_EXPR = re.compile(r'"expression": "\d+([+*-])')


def op_ids(tok) -> dict[str, int]:
    ids = {op: tok(op, add_special_tokens=False)["input_ids"] for op in OPS}
    bad = [op for op, i in ids.items() if len(i) != 1]
    if bad:
        raise SystemExit(f"operator(s) {bad} are not one token of this tokenizer")
    return {op: i[0] for op, i in ids.items()}


@torch.no_grad()
def operator_probs(model, tok, pairs: list[tuple[list[int], str]]) -> dict[str, dict[str, float]]:
    """For each operator a problem holds, the mean probability of each operator at the call's
    operator place (`pairs`: a first turn's prompt ids and its demonstrated call)."""
    ids = op_ids(tok)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    for prompt, target in pairs:
        m = _EXPR.search(target)
        if m is None:
            continue
        prefix = list(prompt) + tok(target[: m.start(1)], add_special_tokens=False)["input_ids"]
        probs = torch.softmax(model(torch.tensor([prefix])).logits[0, -1].float(), -1)
        got = probs[[ids[o] for o in OPS]]
        sums[m[1]] = sums.get(m[1], torch.zeros(len(OPS))) + got
        counts[m[1]] = counts.get(m[1], 0) + 1
    if not counts:
        raise SystemExit("no demonstrated calculator call among the pairs")
    return {want: {o: round(float(p), 4) for o, p in zip(OPS, sums[want] / counts[want], strict=True)}
            for want in sorted(counts)}


def embedding_cosine(model, tok) -> dict[str, float]:
    ids = op_ids(tok)
    e = torch.nn.functional.normalize(model.get_input_embeddings().weight.detach()[[ids[o] for o in OPS]].float(), dim=-1)
    sim = e @ e.T
    return {f"{OPS[i]}{OPS[j]}": round(float(sim[i, j]), 4) for i in range(3) for j in range(i + 1, 3)}


def main() -> int:
    import random

    from flexmarl_core.config import load_config
    from flexmarl_core.models import load_agent_model
    from flexmarl_core.runfiles.weights import initial_weights
    from flexmarl_core.teams import team_shape
    from flexmarl_core.workloads import make_workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "program_react.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--ckpt", nargs="+", required=True, metavar="DIR",
                    help="teams `flexmarl sft` saved (OUT or OUT/step-<N>)")
    ap.add_argument("--agent", default="solver")
    ap.add_argument("--problems", type=int, default=48, help="held-out problems")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config, args.set)
    workload = make_workload(cfg.workload, cfg.team)
    problems = workload.problems("heldout", args.problems, seed=cfg.seed)
    demos = team_shape(cfg).demonstrations(workload, problems, seed=cfg.seed, rng=random.Random(0), perturb=0.0)
    pairs = [(list(p), t) for p, t in demos[args.agent] if _EXPR.search(t)]
    model, tok = load_agent_model(cfg.agent(args.agent).model, seed=cfg.seed)
    model.eval()
    out = {}
    print(f"{'checkpoint':>40s} {'problem op':>10s} " + " ".join(f"{'p(' + o + ')':>7s}" for o in OPS))
    for ckpt in args.ckpt:
        model.load_state_dict(initial_weights(ckpt, args.agent))
        probs, cos = operator_probs(model, tok, pairs), embedding_cosine(model, tok)
        out[ckpt] = {"p_by_problem_operator": probs, "embedding_cosine": cos}
        for want, row in probs.items():
            print(f"{ckpt[-40:]:>40s} {want:>10s} " + " ".join(f"{row[o]:7.3f}" for o in OPS))
        print(f"{'':>40s} embedding cosine " + ", ".join(f"{k} {v:.2f}" for k, v in cos.items()))
    Path(args.json).write_text(json.dumps({"config": args.config, "set": args.set, "problems": len(pairs),
                                           "checkpoints": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
