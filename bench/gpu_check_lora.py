"""bench/gpu_check.py's vLLM LoRA check (`vllm_lora/<preset>`): LoRA agents served by vLLM
(`inference/vllm_lora.py`) against the HF `SharedBaseEngine`, both on the device. Runs only where
vLLM and PEFT import; this project's CPU machines have no vLLM, so this is the path's only check."""

from __future__ import annotations

import copy
from typing import Any

import torch

from bench.engines import gen_prompts
from bench.gpu_check import Plan, logit_scale, rel_tol
from flexmarl_core.config import SamplingConfig


def check_vllm_lora(model: Any, tok: Any, dev: torch.device, plan: Plan) -> dict[str, Any]:
    from flexmarl_core.config import LoraSpec
    from flexmarl_core.inference.lora_engine import SharedBaseEngine
    from flexmarl_core.inference.vllm_lora import VLLMSharedBaseEngine
    from flexmarl_core.models.lora import initial_adapter_state

    spec, agents = LoraSpec(rank=8, alpha=16.0), ("planner", "solver", "verifier")

    def adapter(agent: str, scale: float) -> dict[str, torch.Tensor]:
        # PEFT's init is a no-op adapter (lora_B = 0): perturb it so a mix-up would show.
        g = torch.Generator().manual_seed(len(agent) + int(scale * 100))
        st = initial_adapter_state(model, spec, seed=0, agent=agent)
        return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in st.items()}

    ref = SharedBaseEngine(copy.deepcopy(model).to(dev), tok)
    dut = VLLMSharedBaseEngine.from_model(copy.deepcopy(model), tok, max_loras=len(agents), max_lora_rank=spec.rank)
    try:
        for a in agents:
            st = adapter(a, 0.05)
            ref.add(a, spec, st, 0)
            dut.add(a, spec, st, 0)
        prompts = gen_prompts(plan.check_prompts)
        rows = [agents[i % len(agents)] for i in range(len(prompts))]
        sampling = SamplingConfig(temperature=0.0, top_p=1.0, max_new_tokens=plan.check_new)
        tol = rel_tol(torch.float32, model, backward=False)
        out: dict[str, Any] = {"rel_tol": tol, "rows": len(prompts), "agents": list(agents)}
        for phase in ("initial", "after_update"):
            if phase == "after_update":  # a sync of one agent: its rows must follow the new adapter
                st = adapter("solver", 0.1)
                ref.update_adapter("solver", st, 1)
                dut.update_adapter("solver", st, 1)
            want = ref.generate_mixed(prompts, rows, sampling, seed=0)
            got = dut.generate_mixed(prompts, rows, sampling, seed=0)
            # each side's logits are within tol * scale of the exact ones (the greedy check's bound)
            bound = 2 * tol * logit_scale(model, [w.prompt_ids + w.response_ids for w in want])
            lp, diverged = 0.0, []
            for i, (w, g, a) in enumerate(zip(want, got, rows, strict=True)):
                k = next((j for j, (x, y) in enumerate(zip(w.response_ids, g.response_ids, strict=False)) if x != y),
                         min(len(w.response_ids), len(g.response_ids)))
                lp = max([lp, *(abs(x - y) for x, y in zip(w.logprobs[:k], g.logprobs[:k], strict=True))])
                if w.response_ids == g.response_ids:
                    continue
                if k == min(len(w.response_ids), len(g.response_ids)):
                    diverged.append({"row": i, "agent": a, "step": k, "near_tie": False, "why": "lengths differ"})
                    continue
                # A legitimate divergence: the reference's two candidate tokens are closer than the bound.
                with torch.inference_mode():
                    ids = torch.tensor([w.prompt_ids + w.response_ids[:k]], device=dev)
                    z = ref.model(input_ids=ids, adapter_names=[a]).logits[0, -1].float()
                margin = float(z[w.response_ids[k]] - z[g.response_ids[k]])
                diverged.append({"row": i, "agent": a, "step": k, "margin": margin, "near_tie": margin <= bound})
            out[phase] = {"rows_diverged": len(diverged), "divergences": diverged, "max_logprob_diff": lp,
                          "logprob_bound": bound,
                          "versions_ok": all(g.version == w.version for w, g in zip(want, got, strict=True)),
                          "passed": lp <= bound and all(d["near_tie"] for d in diverged)}
            out[phase]["passed"] = out[phase]["passed"] and out[phase]["versions_ok"]
        out["passed"] = out["initial"]["passed"] and out["after_update"]["passed"]
        return out
    finally:
        dut.close()
