"""Drawing the next token of each row of a shared decode: every request with its own generator,
temperature and top-p, so a request samples what it would alone; and which rows leave the
batch as they end (`inference/hf.py`'s decode loop)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import groupby

import torch

from flexmarl_core.config import SamplingConfig
from flexmarl_core.models.logprobs import token_logprobs

#: a request of one decode: its rows [lo, hi) in the batch, its sampling and seed
Span = tuple[int, int, SamplingConfig, int]


def sample_next(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator
) -> torch.Tensor:
    """(B, V) fp32 logits -> (B,) token ids: greedy at temperature 0, else temperature + top-p."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    return draw(logits, sampling, torch.rand((logits.shape[0], 1), generator=generator, device=logits.device))


def _runs(live: Sequence[int], spans: Sequence[tuple[int, int, SamplingConfig, int]]) -> list[list[int]]:
    """`live` requests cut into runs of neighbours that share temperature and top-p."""
    return [list(g) for _, g in groupby(live, key=lambda j: (spans[j][2].temperature, spans[j][2].top_p))]


def draw(logits: torch.Tensor, sampling: SamplingConfig, u: torch.Tensor) -> torch.Tensor:
    """(B, V) fp32 logits, (B, 1) uniforms in [0, 1) -> (B,) token ids at `sampling`'s temperature
    and top-p (> 0). Every op is row-wise, so a row's token does not depend on the rows beside it:
    requests that share a decode draw their own `u` and get what they would get alone."""
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= sampling.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    # Inverse-CDF draw: one uniform per row, ~10x cheaper than torch.multinomial on CPU. Scaling
    # u by the row total keeps it inside the CDF despite rounding; a zero-probability token is
    # never the first index where the (flat there) CDF reaches u.
    cdf = probs.cumsum(dim=-1)  # (B, V)
    return (cdf < u * cdf[:, -1:]).sum(dim=-1).clamp_(max=probs.shape[-1] - 1)


def sample_rows(logits: torch.Tensor, rows: Sequence[int], live: Sequence[int], spans: Sequence[Span],
                gens: Sequence[torch.Generator], temps: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, V) logits of the batch's rows (`rows`: their indices among all rows, ascending; the
    live requests' rows that have not ended) -> (b,) tokens and (b,) their logprobs: each request
    over its own rows, with its own generator, temperature and top-p (a run of neighbours with
    one temperature and top-p draws and scores as one batch). A request draws a uniform for
    each of its rows, ended or not, and its live rows take theirs: so a request's tokens are
    the ones it would draw alone, whichever of its rows have ended."""
    picks, scores, at = [], [], 0
    for run in _runs(live, spans):
        s = spans[run[0]][2]
        parts = [(j, bisect_left(rows, spans[j][0]), bisect_left(rows, spans[j][1])) for j in run]
        n = sum(hi - lo for _, lo, hi in parts)
        lg = logits[at : at + n]
        if s.temperature == 0:
            picks.append(lg.argmax(dim=-1))
        else:
            us = []
            for j, lo, hi in parts:
                u = torch.rand((spans[j][1] - spans[j][0], 1), generator=gens[j], device=logits.device)
                if hi - lo < len(u):  # some of its rows ended: the others keep their own draws
                    u = u[torch.tensor([r - spans[j][0] for r in rows[lo:hi]], dtype=torch.long, device=u.device)]
                us.append(u)
            picks.append(draw(lg, s, torch.cat(us)))
        scores.append(token_logprobs(lg, picks[-1], temps[run[0]]))
        at += n
    return torch.cat(picks), torch.cat(scores)


def evict_ended(rows: Sequence[int], live: Sequence[int], spans: Sequence[Span],
                ended: Sequence[bool]) -> tuple[list[int], list[int]] | None:
    """None while every row of the batch (`rows`, indices among all rows) is still decoding;
    else (the batch positions to keep, the requests with a row still decoding). `ended` is per
    row of the whole decode."""
    keep = [p for p, r in enumerate(rows) if not ended[r]]
    if len(keep) == len(rows):
        return None
    kept = [rows[p] for p in keep]
    still = [j for j in live if bisect_left(kept, spans[j][1]) > bisect_left(kept, spans[j][0])]
    return keep, still


def select_row_kwargs(fkw: Mapping[str, object], keep: Sequence[int], nrows: int) -> dict[str, object]:
    """Forward arguments after rows left the batch: a per-row list (a LoRA engine's
    `adapter_names`, one adapter group per request) keeps the kept rows' entries."""
    return {k: [v[i] for i in keep] if isinstance(v, list) and len(v) == nrows else v for k, v in fkw.items()}
