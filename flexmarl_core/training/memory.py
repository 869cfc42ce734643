"""How many tokens one forward/backward may hold, so training memory does not grow with the batch.

A micro-batch is whole GRPO groups, and its size is a scheduling choice (fewer, larger tasks
carry less bookkeeping); its memory must not follow. The trainer splits each micro-batch into
chunks of rows whose padded size (rows x longest row) stays under a token budget
(`backend.train_chunk_tokens`), runs forward and backward per chunk, and lets the gradients
add up: the loss is a token sum, so the result is the micro-batch's gradient.

The default budget is a share of the worker's memory limit divided by the bytes a token costs
in training. That cost was measured here (fp32, Qwen2 presets, peak RSS of one forward +
backward, bench note in `bytes_per_token`) and fits

    bytes/token ~ 4 * (layers * (14 * hidden + 4 * intermediate) + 3 * vocab)

(the saved activations of each layer, and the logits with their softmax and gradient).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import psutil

from flexmarl_core.ops import MEMORY_ENV

#: Share of the worker's memory limit one chunk may take: the rest holds the engines, the
#: trainer state (weights, grads, two Adam moments), the reference model, and Dask's 95%
#: restart line stays far away.
CHUNK_MEMORY_SHARE = 0.3


def bytes_per_token(model_config: Any, *, activation_checkpointing: bool = False) -> float:
    """Peak training bytes per token of a causal LM config (hidden_size, num_hidden_layers,
    intermediate_size, vocab_size). Fit to peak RSS of one fp32 forward + backward on this
    machine: tiny-1m 80 KiB/token (formula 72), tiny-10m 306 KiB/token (formula 304);
    with activation checkpointing tiny-10m took 198 KiB/token, so two thirds are kept."""
    h = int(model_config.hidden_size)
    layers = int(model_config.num_hidden_layers)
    inter = int(getattr(model_config, "intermediate_size", 4 * h) or 4 * h)
    vocab = int(model_config.vocab_size)
    per_layer = 14 * h + 4 * inter
    total = 4.0 * (layers * per_layer + 3 * vocab)
    return total * (2.0 / 3.0) if activation_checkpointing else total


def worker_memory_limit() -> int:
    """This process's memory limit in bytes: the Dask worker's (set by `cluster.workers`), else the
    machine's total memory (a trainer in the flow process, in tests, in `flexmarl sft`)."""
    raw = os.environ.get(MEMORY_ENV)
    if raw:
        return int(raw)
    return int(psutil.virtual_memory().total)


def default_chunk_tokens(model_config: Any, *, activation_checkpointing: bool = False,
                         memory_limit: int | None = None) -> int:
    """The token budget of one forward/backward: `CHUNK_MEMORY_SHARE` of the memory limit
    over the bytes a token costs (at least one 2048-token row, the presets' context)."""
    limit = memory_limit if memory_limit is not None else worker_memory_limit()
    per = bytes_per_token(model_config, activation_checkpointing=activation_checkpointing)
    return max(int(CHUNK_MEMORY_SHARE * limit / per), 2048)


def chunk_rows(lengths: Sequence[int], budget: int | None) -> list[list[int]]:
    """Rows of a micro-batch grouped so each group's padded size (rows x longest row) is at
    most `budget` tokens. One group of all rows, in order, when the whole micro-batch fits
    (then training is exactly what it was without chunking); otherwise rows go longest first,
    so each chunk pads only to its own longest row. A row longer than the budget is a chunk
    alone (it cannot be split: its tokens attend to each other)."""
    n = len(lengths)
    if budget is None or n * max(lengths, default=0) <= budget:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    chunks: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        # Longest first: the chunk's padded width is its first row's length.
        if cur and (len(cur) + 1) * lengths[cur[0]] > budget:
            chunks.append(cur)
            cur = []
        cur.append(i)
    if cur:
        chunks.append(cur)
    return chunks
