"""`flexmarl export`: a run's agents as Hugging Face folders, written whole or not at all.

    OUT/<agent>/config.json, model.safetensors (sharded past `max_shard_size`), tokenizer files
               with the agent's chat template, generation_config.json, README.md (model card)
    OUT/<agent>/adapter_config.json, adapter_model.safetensors   (--adapter, LoRA agents)
    OUT/base-<key>/                    the base an adapter names, when no folder or hub id holds it
    OUT/config.yaml                    the run's config
    OUT/flexmarl-export.json           what was exported (`flexmarl serve OUT` reads it)

Everything is written into a temporary folder beside OUT, renamed into place at the end: a
failure leaves OUT as it was. `--overwrite` replaces only a folder that is an export (or empty).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from flexmarl_core.config import AgentConfig
from flexmarl_core.export.card import model_card
from flexmarl_core.export.versions import LATEST, RunReadError, TrainedRun
from flexmarl_core.export.weights import AgentWeights, agent_weights
from flexmarl_core.inference.vllm_lora import save_peft_adapter  # imports vllm only when used
from flexmarl_core.models import load_agent_model
from flexmarl_core.models.lora import base_key
from flexmarl_core.programs.chat import template_source
from flexmarl_core.runfiles.location import CONFIG_NAME, is_uri

MANIFEST = "flexmarl-export.json"
#: transformers' shard size before its default grew to 50GB: what hub tooling expects
DEFAULT_SHARD = "5GB"


def check_out(out: str, overwrite: bool) -> Path:
    """The export folder `out`, refused (before any weights load) if it cannot be written."""
    if is_uri(out):
        raise RunReadError(f"--out {out}: export writes a local folder (from_pretrained loads one); "
                           "copy it to object storage afterwards")
    path = Path(out).expanduser().absolute()
    if path.exists():
        if not overwrite:
            raise RunReadError(f"--out {out}: the folder exists; give --overwrite to replace it")
        if not path.is_dir() or (any(path.iterdir()) and not (path / MANIFEST).is_file()):
            raise RunReadError(f"--out {out}: exists and is not a flexmarl export (no {MANIFEST}); "
                               "--overwrite replaces only an export: choose another folder")
    if not os.access(_existing_parent(path), os.W_OK):
        raise RunReadError(f"--out {out}: cannot write in {_existing_parent(path)}")
    return path


def _existing_parent(path: Path) -> Path:
    p = path.parent
    while not p.exists():
        p = p.parent
    return p


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out` that replaces it when the block ends (and is removed if
    it raises)."""
    token = secrets.token_hex(4)
    tmp = out.with_name(f".{out.name}.tmp-{token}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        old = out.with_name(f".{out.name}.old-{token}")
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def generation_config(agent: AgentConfig, model: Any, tok: Any) -> GenerationConfig:
    """The agent's training sampling as transformers' generation defaults."""
    s = agent.sampling
    eos = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    own = getattr(model.generation_config, "eos_token_id", None)
    eos |= {int(i) for i in (own if isinstance(own, list | tuple) else [own] if own is not None else [])}
    sampled = {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p} if s.temperature > 0 else {
        "do_sample": False}
    return GenerationConfig(**sampled, max_new_tokens=s.max_new_tokens, stop_strings=list(s.stop) or None,
                            eos_token_id=sorted(eos) or None, pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.bos_token_id)


def _save_tokenizer(tok: Any, agent: AgentConfig, folder: Path) -> None:
    """The tokenizer with the chat template the agent was trained with (its prompts' format)."""
    tok.chat_template = template_source(agent.chat_template, tok)
    tok.save_pretrained(str(folder))


def _load_snippet(folder: Path, agent: AgentConfig, base: str | None) -> str:
    content = json.dumps(agent.template or "your message")
    msgs = ([f'{{"role": "system", "content": {json.dumps(agent.system)}}}, '] if agent.system else []) + [
        f'{{"role": "user", "content": {content}}}']
    load = (f'model = AutoPeftModelForCausalLM.from_pretrained("{folder}")  # and its base, {base}'
            if base is not None else f'model = AutoModelForCausalLM.from_pretrained("{folder}")')
    return "\n".join([
        "from transformers import AutoModelForCausalLM, AutoTokenizer" if base is None else
        "from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer",
        load, f'tok = AutoTokenizer.from_pretrained("{folder}")',
        f"messages = [{''.join(msgs)}]",
        "text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)",
        'ids = tok(text, return_tensors="pt", add_special_tokens=False)',
        "out = model.generate(**ids, tokenizer=tok)  # generation_config.json: the training sampling",
        'print(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))'])


class _Writer:
    """Writes one export into `tmp`, whose final name is `final`."""

    def __init__(self, run: TrainedRun, tmp: Path, final: Path, max_shard_size: str) -> None:
        self.run, self.tmp, self.final, self.shard = run, tmp, final, max_shard_size
        self.bases: dict[str, str] = {}  # base key -> the folder an adapter names

    def full(self, w: AgentWeights) -> dict[str, Any]:
        a, folder = w.agent, self.tmp / w.agent.name
        w.model.generation_config = generation_config(a, w.model, w.tokenizer)
        w.model.save_pretrained(str(folder), max_shard_size=self.shard)
        _save_tokenizer(w.tokenizer, a, folder)
        kind = (f"Its LoRA adapter (rank {w.spec.rank}) is merged into its base: a plain model"
                if w.spec is not None else "Full weights")
        self._card(w, folder, kind, None)
        return {"kind": "merged" if w.spec is not None else "full"}

    def adapter(self, w: AgentWeights) -> dict[str, Any]:
        a, folder = w.agent, self.tmp / w.agent.name
        assert w.spec is not None and w.adapter is not None
        base = self._base(w)
        save_peft_adapter(folder, w.spec, w.adapter, base_name=base)
        generation_config(a, w.model, w.tokenizer).save_pretrained(str(folder))
        _save_tokenizer(w.tokenizer, a, folder)
        self._card(w, folder, f"A LoRA adapter (PEFT, rank {w.spec.rank}) on the base `{base}`", base)
        return {"kind": "adapter", "base": base}

    def _base(self, w: AgentWeights) -> str:
        """What the adapter names as its base: the agent's hub id or folder when the run's base
        is that model as it is, else a folder of the run's base written beside the adapters."""
        m = w.agent.model
        key = base_key(m, self.run.cfg.seed)
        if key not in self.bases:
            if w.base_is_source():
                self.bases[key] = m.hub_id or str(m.folder())
            else:
                model, tok = load_agent_model(m, seed=self.run.cfg.seed)
                model.load_state_dict(w.base or {})
                model.save_pretrained(str(self.tmp / f"base-{key}"), max_shard_size=self.shard)
                tok.save_pretrained(str(self.tmp / f"base-{key}"))
                self.bases[key] = str(self.final / f"base-{key}")
        return self.bases[key]

    def _card(self, w: AgentWeights, folder: Path, kind: str, base: str | None) -> None:
        load = _load_snippet(self.final / w.agent.name, w.agent, base)
        text = model_card(self.run, w.agent, w.version, kind=kind, base_name=base, load=load)
        (folder / "README.md").write_text(text)


def export_team(run: TrainedRun, out: str, *, agents: Sequence[str] | None = None, version: int | str = LATEST,
                adapter: bool = False, overwrite: bool = False, max_shard_size: str = DEFAULT_SHARD,
                log: Callable[[str], None] = print) -> dict[str, int]:
    """Export `agents` (all) of `run` at `version` into the folder `out`; returns each agent's
    version. Bad input (`RunReadError`) is refused before anything is written."""
    final = check_out(out, overwrite)
    chosen = run.agents(agents)
    versions = run.resolve(chosen, version)
    manifest: dict[str, Any] = {"run": run.where, "name": run.cfg.name, "agents": {}}
    with staged(final) as tmp:
        writer = _Writer(run, tmp, final, max_shard_size)
        for a in chosen:
            w = agent_weights(run, a, versions[a.name])
            entry = writer.adapter(w) if adapter and w.spec is not None else writer.full(w)
            manifest["agents"][a.name] = {"folder": a.name, "version": versions[a.name], **entry,
                                          "config": a.model_dump(mode="json")}
            log(f"{a.name}: version {versions[a.name]} -> {final / a.name} ({entry['kind']})")
            del w
        (tmp / CONFIG_NAME).write_text(run.loc.read_text(CONFIG_NAME))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return versions
