"""Experiment configuration: one YAML file per experiment, validated with pydantic.

The one import path for users: the models (`models.py`, an agent's in
`agent.py`, the cluster's in `cluster.py`, the co-design switches in `codesign.py`), the readers (`load.py`: files, text, `a.b.c=value` overrides, and
the checks that need the registries and the team graph) and `ConfigError`, which names the
file and the field.

    cfg = load_config("configs/default.yaml", overrides=["batch.group_size=8"])
"""

from __future__ import annotations

from flexmarl_core.config.agent import (
    AgentConfig,
    AlgorithmConfig,
    BackendConfig,
    CriticConfig,
    LoraSpec,
    ModelConfig,
    SamplingConfig,
)
from flexmarl_core.config.checks import PRESET_NAMES, ConfigError, backend_available
from flexmarl_core.config.cluster import ClusterConfig, WorkerConfig
from flexmarl_core.config.codesign import REQUIRES, SWITCHES, CodesignConfig, switch_overrides
from flexmarl_core.config.load import (
    check_config,
    config_from_dict,
    config_from_text,
    load_config,
    parse_overrides,
)
from flexmarl_core.config.models import (
    BatchConfig,
    EdgeConfig,
    ExperimentConfig,
    StoreConfig,
    TeamConfig,
    TrainConfig,
    WorkloadConfig,
)

__all__ = [
    "PRESET_NAMES", "REQUIRES", "SWITCHES", "AgentConfig", "AlgorithmConfig", "BackendConfig", "BatchConfig", "ClusterConfig",
    "CodesignConfig", "CriticConfig", "ConfigError", "EdgeConfig", "ExperimentConfig", "LoraSpec", "ModelConfig",
    "SamplingConfig", "StoreConfig", "TeamConfig", "TrainConfig", "WorkerConfig", "WorkloadConfig",
    "backend_available", "check_config", "config_from_dict", "config_from_text", "load_config",
    "parse_overrides", "switch_overrides",
]
