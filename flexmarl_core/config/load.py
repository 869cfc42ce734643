"""Reading experiment configs: YAML files or text, `a.b.c=value` overrides, validation errors
that name the file and the field path, and the checks that need more than the models (the
algorithm registries, the team graph). The models are in `models.py`, `agent.py` and
`cluster.py`; import both from `flexmarl_core.config`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flexmarl_core.config.checks import ConfigError
from flexmarl_core.config.critic import critic_problems
from flexmarl_core.config.models import ExperimentConfig
from flexmarl_core.meg import MEG, MEGError


def _set_path(data: dict[str, Any], dotted: str, value: Any, *, source: str) -> None:
    """Apply one `a.b.c=value` override; list items are addressed by agent name or index."""
    keys = dotted.split(".")
    node: Any = data
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            idx = _list_index(node, key, source=source, dotted=dotted)
            if last:
                node[idx] = value
            else:
                node = node[idx]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"{source}: override {dotted!r}: {'.'.join(keys[:i])} is not a mapping")
        if last:
            node[key] = value
        else:
            node = node.setdefault(key, {})


def _list_index(node: list[Any], key: str, *, source: str, dotted: str) -> int:
    if key.isdigit():
        if int(key) >= len(node):
            raise ConfigError(
                f"{source}: override {dotted!r}: index {key} is past the end of a list of {len(node)}"
            )
        return int(key)
    for j, item in enumerate(node):
        if isinstance(item, dict) and item.get("name") == key:
            return j
    names = [item.get("name") for item in node if isinstance(item, dict)]
    raise ConfigError(f"{source}: override {dotted!r}: no list item named {key!r} (have {names})")


def parse_overrides(overrides: list[str], *, source: str = "--set") -> list[tuple[str, Any]]:
    out = []
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"{source}: override {ov!r} must look like key.path=value")
        key, raw = ov.split("=", 1)
        if not key.strip():
            raise ConfigError(f"{source}: override {ov!r} has no key before '='")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(
                f"{source}: override {ov!r}: the value is not valid YAML ({what}); quote it"
            ) from None
        out.append((key.strip(), value))
    return out


def config_from_dict(
    data: dict[str, Any], *, source: str = "<dict>", overrides: list[str] | None = None
) -> ExperimentConfig:
    data = dict(data)
    for key, value in parse_overrides(overrides or []):
        _set_path(data, key, value, source=source)
    try:
        cfg = ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        # One line (the CLI prints errors as one `error:` line), every problem in it.
        problems = [
            f"{_readable_loc(data, err['loc'])}{err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        ]
        raise ConfigError(f"{source}: " + "; ".join(problems).replace("\n", " ")) from None
    check_config(cfg, source=source)
    return cfg


def check_config(cfg: ExperimentConfig, *, source: str = "<config>") -> None:
    """What the models alone cannot check, so `flexmarl train` stops here, before a Prefect
    server, a cluster or a run folder exists: the team graph (duplicate agents, unknown or
    cyclic edges, stray template fields), the critic's needs and the policy losses' registry."""
    try:
        MEG.from_config(cfg.team)
    except MEGError as exc:
        raise ConfigError(f"{source}: team: {exc}") from None
    for problem in critic_problems(cfg):
        raise ConfigError(f"{source}: {problem}")
    k = cfg.codesign.max_staleness
    if k == 0:
        return
    from flexmarl_core.algorithms.losses import POLICY_LOSSES  # torch: only for stale configs

    for a in cfg.team.agents:
        name = a.algorithm.policy_loss
        if a.trainable and name in POLICY_LOSSES and not POLICY_LOSSES.info(name).get("off_policy"):
            raise ConfigError(
                f"{source}: codesign.max_staleness={k}: agent {a.name!r} uses policy_loss {name!r}, which "
                "assumes on-policy samples; set its algorithm.policy_loss to decoupled_ppo"
            )


def _readable_loc(data: Any, loc: tuple[Any, ...]) -> str:
    """`team.agents.1.sampling` -> `team.agents[solver].sampling: ` when the item has a name
    (nothing for the root: its messages name their keys themselves)."""
    parts: list[str] = []
    node = data
    for key in loc:
        if isinstance(key, int) and isinstance(node, list):
            item = node[key] if key < len(node) else None
            name = item.get("name") if isinstance(item, dict) else None
            parts[-1:] = [f"{parts[-1] if parts else ''}[{name if name else key}]"]
            node = item
        else:
            parts.append(str(key))
            node = node.get(key) if isinstance(node, dict) else None
    return f"{'.'.join(parts)}: " if parts else ""


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> ExperimentConfig:
    """Read, override and validate one experiment file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: cannot read config: not UTF-8 text (byte {exc.start})") from None
    return config_from_text(text, source=str(p), overrides=overrides)


#: `run_dir` of a run folder's own config.yaml: the folder it is read from, wherever that is
#: now (a run folder copied or moved resumes where it is)
HERE = "{here}"


def config_from_text(text: str, *, source: str, overrides: list[str] | None = None) -> ExperimentConfig:
    """Parse (YAML, safe loader: plain data only), override and validate one experiment;
    `source` names it in errors (a path or URI), and is where `run_dir: {here}` points (the
    folder of the file)."""
    p = source
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # One line, with the position: PyYAML's own message spans several lines.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{p}: not valid YAML{where}: {what}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(data).__name__}")
    if isinstance(data.get("run_dir"), str) and HERE in data["run_dir"]:
        folder = p.rsplit("/", 1)[0] if "://" in p else str(Path(p).resolve().parent)
        data["run_dir"] = data["run_dir"].replace(HERE, folder)
    return config_from_dict(data, source=p, overrides=overrides)
