"""HF transformers rollout engine: our own batched sampling loop over a KV cache.

Why not `model.generate`: we need (a) the exact logprob of each sampled token under the
contract of `inference/api.py`, (b) sampling seeded per call through a private
`torch.Generator` (no global RNG side effects), (c) stop strings checked while generating. The
loop is the same prefill + one-token decode steps `generate` runs, minus its per-step logits
processor / stopping-criteria machinery, so it is as fast or faster (bench/engines.py).

Steps of `generate`:
  1. tokenize, left-pad to (B, P); position ids count real tokens only, so padding is invisible;
  2. prefill the prompt, keep the logits of the last position;
  3. per step: sample (B,) tokens, score them, append, check EOS / stop strings, decode one token;
  4. cut each row at its end and build `Generation`s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference.api import DecodeClock, FinishReason, Generation, synced_now
from flexmarl_core.inference.sampling import evict_ended, sample_rows, select_row_kwargs
from flexmarl_core.models.logprobs import scoring_temperature


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids: set[int] = set()
    for src in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple):
            ids.update(int(i) for i in src)
    return sorted(ids)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str] | Sequence[Sequence[int]]
) -> list[list[int]]:
    """Prompt strings (no special tokens added) or token ids -> token ids; empty is an error."""
    out = []
    known: dict[str, list[int]] = {}  # a GRPO group's G rows share one prompt: encode it once
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if p not in known:
                known[p] = tokenizer.encode(p, add_special_tokens=False)
            ids = list(known[p])
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        out.append(ids)
    return out


class HFInferenceEngine:
    """`InferenceBackend` on a transformers causal LM (CPU or one GPU).

    The engine owns `model` (it is put in eval mode and its weights are overwritten by
    `update_weights`); give a trainer its own copy.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        version: int = 0,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._version = version
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        # Tied models share lm_head with the embedding, so a state dict may omit it.
        self._tied = bool(getattr(model.config, "tie_word_embeddings", False))
        #: prefill each distinct prompt once and copy its cache to the rows that share it
        self.share_prefill = True
        #: seconds spent prefilling and decoding, for a rollout's prefill share (`DecodeClock`)
        self.clock = DecodeClock()
        #: the text of each recent tail of tokens a stop string was looked for in: the same few
        #: tails come back every step, and decoding them is most of a small model's stop check
        self._tail_text: dict[tuple[int, ...], str] = {}

    @property
    def version(self) -> int:
        return self._version

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- weights ------------------------------------------------------------------------------
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state_dict))
        if self._tied:
            missing = [k for k in missing if k != "lm_head.weight"]
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"update_weights(version={version}): state dict does not match the model; "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}. "
                "Send the trainer's full weights() (lm_head.weight included)."
            )
        with torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor)  # copy_ casts to the engine's dtype/device
        self._version = int(version)

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int,
    ) -> list[Generation]:
        return self._generate(prompts, sampling, seed)

    def generate_partial(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int,
        refresh: Callable[[], bool],
        every: int = 16,
    ) -> list[Generation]:
        """`generate`, calling `refresh` every `every` decode steps: when it loaded newer weights
        into this engine (returns True), the rows still decoding resume under them. Their
        context (prompt and tokens so far) is prefilled again with the new weights, so every
        later token is sampled, and scored, by the new weights alone. Each generation keeps the
        version it started with (`version`, the oldest of its tokens) and, when it spans
        versions, the version of every token (`token_versions`)."""
        return self._generate_groups([(prompts, sampling, seed)], refresh=(refresh, max(int(every), 1)))

    def generate_groups(
        self, groups: Sequence[tuple[Sequence[str] | Sequence[Sequence[int]], SamplingConfig, int]]
    ) -> list[list[Generation]]:
        """One decode for several requests `(prompts, sampling, seed)`, each sampled with its
        own sampling and seed (the tokens it would get alone); their generations in order."""
        gens = self._generate_groups(groups)
        out, at = [], 0
        for prompts, _, _ in groups:
            out.append(gens[at : at + len(prompts)])
            at += len(prompts)
        return out

    def _generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int,
        forward_kwargs: Mapping[str, object] | None = None,
        versions: Sequence[int] | None = None,
    ) -> list[Generation]:
        """`generate`, with extra model-forward arguments (a LoRA engine's per-row
        `adapter_names`) and a weights version per row (default: the engine's)."""
        return self._generate_groups([(prompts, sampling, seed)], forward_kwargs, versions)

    def _generate_groups(
        self,
        groups: Sequence[tuple[Sequence[str] | Sequence[Sequence[int]], SamplingConfig, int]],
        forward_kwargs: Mapping[str, object] | None = None,
        versions: Sequence[int] | None = None,
        refresh: tuple[Callable[[], bool], int] | None = None,
    ) -> list[Generation]:
        """One decode over several requests (prompts, sampling, seed), their rows in order.

        Each request draws from its own generator seeded by its own seed, over its own rows
        only, with its own temperature, top-p, stop strings and length, so its tokens are the
        ones it would sample alone (the shared forward pass changes the logits' summation order
        only: a few ulps, see tests/unit/test_lora.py). One request is exactly `generate`. The parts
        of a step are functions of their own: `sample_rows` (sampling), `evict_ended`
        (requests that ended leave the batch), `select_row_kwargs` (a LoRA engine's per-row
        adapter names follow their rows), `reprefill` (a partial rollout resumes under newer
        weights) and `token_versions` (which weights sampled each token)."""
        t_call = synced_now(self.device)
        spans, all_prompts = [], []
        for prompts, sampling, seed in groups:
            spans.append((len(all_prompts), len(all_prompts) + len(prompts), sampling, seed))
            all_prompts += list(prompts)
        spans = [s for s in spans if s[1] > s[0]]
        if not spans:
            return []
        fkw = dict(forward_kwargs or {})
        prompt_ids = encode_prompts(self.tokenizer, all_prompts)
        dev = self.device
        bsz = len(prompt_ids)
        max_new = max(s[2].max_new_tokens for s in spans)
        gens = [torch.Generator(device=dev).manual_seed(int(s[3])) for s in spans]
        temps = [scoring_temperature(s[2].temperature) for s in spans]
        # A request shorter than the decode ends its rows at its own max_new_tokens.
        row_max = torch.tensor([s[2].max_new_tokens for s in spans for _ in range(s[1] - s[0])],
                               dtype=torch.long, device=dev)

        # 1. left padding: (B, P)
        input_ids, attn, pos = left_pad(prompt_ids, self.pad_id, dev)
        tokens = torch.full((bsz, max_new), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros((bsz, max_new), dtype=torch.float32, device=dev)
        lengths = torch.zeros(bsz, dtype=torch.long, device=dev)
        done = torch.zeros(bsz, dtype=torch.bool, device=dev)
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=dev)
        stop_hit = [False] * bsz
        # A stop string of n bytes spans at most n + 1 byte-level tokens (last one may overhang).
        windows = [max((len(st.encode()) for st in s[2].stop), default=0) + 1 for s in spans]
        start_version = self._version
        switches: list[tuple[int, int]] = []  # (first step sampled by them, weights version)
        schemas = [s[2].json_schema for s in spans for _ in range(s[1] - s[0])]
        constraints = None
        if any(x is not None for x in schemas):
            from flexmarl_core.inference.constrained import RowConstraints

            constraints = RowConstraints(self.tokenizer, self.eos_ids, schemas, prompt_ids)

        with torch.inference_mode():
            # 2. prefill: each distinct prompt once (a GRPO group's G rows share theirs), its cache
            # and last logits then copied to every row that has it
            with self.clock.prefilling(dev):
                first, copies = distinct_rows(prompt_ids, fkw, dev) if self.share_prefill else (None, None)
                pf = (input_ids, attn, pos, fkw) if first is None else (
                    input_ids[first], attn[first], pos[first], select_row_kwargs(fkw, first.tolist(), bsz))
                out = self.model(input_ids=pf[0], attention_mask=pf[1], position_ids=pf[2], use_cache=True,
                                 logits_to_keep=1, **pf[3])
                cache = out.past_key_values
                logits = out.logits[:, -1].float()  # (B, V)
                if copies is not None:
                    cache.batch_select_indices(copies)
                    logits = logits[copies]
            live = list(range(len(spans)))  # the requests in the model's batch, in row order
            rows = torch.arange(bsz, device=dev)  # the batch's rows as indices into all rows
            row_list = list(range(bsz))  # the same, ascending
            for step in range(max_new):
                # 3. sample, score, append; check EOS, lengths and stop strings
                if constraints is not None:  # a schema's rows draw and score among the tokens it allows
                    constraints.apply(logits, rows, tokens, lengths, done)
                nxt, scores = sample_rows(logits, row_list, live, spans, gens, temps)  # (b,), (b,)
                running = ~done[rows]
                tokens[rows, step] = torch.where(running, nxt, self.pad_id)
                logps[rows, step] = scores
                lengths[rows] += running.long()
                if eos.numel():
                    done[rows] |= running & torch.isin(nxt, eos)
                done |= lengths >= row_max
                if any(spans[j][2].stop for j in live):
                    self._check_stops(tokens, lengths, done, stop_hit, [spans[j] for j in live],
                                      [windows[j] for j in live])
                if bool(done.all()) or step == max_new - 1:
                    break
                # 4. rows that ended leave the batch: they would only pad it
                evicted = evict_ended(row_list, live, spans, done.tolist())
                if evicted is not None:
                    keep, live = evicted
                    row_list = [row_list[p] for p in keep]
                    idx = torch.tensor(keep, dtype=torch.long, device=dev)
                    fkw = select_row_kwargs(fkw, keep, len(rows))
                    rows, attn, pos, nxt = rows[idx], attn[idx], pos[idx], nxt[idx]
                    cache.batch_select_indices(idx)
                attn = torch.cat([attn, attn.new_ones((len(rows), 1))], dim=-1)
                # 5. the next token's logits: one decode step, or a re-prefill under newer weights
                if refresh is not None and (step + 1) % refresh[1] == 0 and refresh[0]():
                    switches.append((step + 1, self._version))
                    with self.clock.prefilling(dev):
                        out, pos = reprefill(self.model, input_ids, tokens, rows, step, nxt, attn, fkw)
                else:
                    pos = pos[:, -1:] + 1
                    out = self.model(input_ids=nxt.unsqueeze(-1), attention_mask=attn, position_ids=pos,
                                     past_key_values=cache, use_cache=True, **fkw)
                cache = out.past_key_values
                logits = out.logits[:, -1].float()

        # 6. build outputs
        tok_rows, lp_rows, len_list = tokens.tolist(), logps.tolist(), lengths.tolist()
        eos_set = set(self.eos_ids)
        vers = list(versions) if versions is not None else [start_version] * bsz
        out_gens = [
            finish_generation(self.tokenizer, prompt_ids[i], tok_rows[i][: len_list[i]],
                              lp_rows[i][: len_list[i]], s.stop, eos_set, vers[i])
            for lo, hi, s, _ in spans for i in range(lo, hi)
        ]
        token_versions(out_gens, switches, start_version)
        self.clock.generate_s += synced_now(dev) - t_call
        return out_gens

    def _check_stops(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        done: torch.Tensor,
        stop_hit: list[bool],
        spans: Sequence[tuple[int, int, SamplingConfig, int]],
        windows: Sequence[int],
    ) -> None:
        """Mark the rows of `spans` (requests) whose newest tokens complete one of their own
        request's stop strings: one short tail decode for every live row at once."""
        ended = done.tolist()
        rows, stops, wins = [], [], []
        for (lo, hi, s, _), w in zip(spans, windows, strict=True):
            if s.stop:
                live = [r for r in range(lo, hi) if not ended[r]]
                rows += live
                stops += [s.stop] * len(live)
                wins += [w] * len(live)
        if not rows:
            return
        idx = torch.tensor(rows, dtype=torch.long, device=tokens.device)
        ends = lengths[idx].tolist()
        # only the columns the windows cover leave the tensor (not a long decode's whole history)
        lo, hi = max(0, min(e - w for e, w in zip(ends, wins, strict=True))), max(ends)
        cols = tokens[idx, lo:hi].tolist()
        tails = [tuple(c[max(0, e - w) - lo : e - lo]) for c, e, w in zip(cols, ends, wins, strict=True)]
        known = self._tail_text
        new = list(dict.fromkeys(t for t in tails if t not in known))
        if new:
            if len(known) + len(new) > TAIL_CACHE:
                # start over, with every tail this check reads (those it knew included)
                known.clear()
                new = list(dict.fromkeys(tails))
            known.update(zip(new, self.tokenizer.batch_decode([list(t) for t in new], skip_special_tokens=False),
                             strict=True))
        for r, tail, st in zip(rows, tails, stops, strict=True):
            if any(x in known[tail] for x in st):
                done[r] = True
                stop_hit[r] = True


#: tails of tokens whose text an engine keeps for its stop checks (then it starts over)
TAIL_CACHE = 65_536

def distinct_rows(prompt_ids: Sequence[Sequence[int]], fkw: Mapping[str, object],
                  device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(one row per distinct prompt, and for every row the index of its distinct one), or
    (None, None) when every row is distinct. Rows are alike when their prompt ids and their
    per-row forward arguments (a LoRA engine's adapter name) are."""
    per_row = [v for v in fkw.values() if isinstance(v, list) and len(v) == len(prompt_ids)]
    seen: dict[tuple[Any, ...], int] = {}
    first: list[int] = []
    copies: list[int] = []
    for i, ids in enumerate(prompt_ids):
        key = (tuple(ids), *(v[i] for v in per_row))
        if key not in seen:
            seen[key] = len(first)
            first.append(i)
        copies.append(seen[key])
    if len(first) == len(prompt_ids):
        return None, None
    return (torch.tensor(first, dtype=torch.long, device=device),
            torch.tensor(copies, dtype=torch.long, device=device))


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_id: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention mask, position ids), each (B, P): prompts left-padded to the
    longest, positions counting real tokens only, so padding is invisible to the model."""
    bsz, plen = len(prompt_ids), max(len(p) for p in prompt_ids)
    input_ids = torch.full((bsz, plen), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros((bsz, plen), dtype=torch.long, device=device)
    for i, ids in enumerate(prompt_ids):
        input_ids[i, plen - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attn[i, plen - len(ids) :] = 1
    return input_ids, attn, (attn.cumsum(-1) - 1).clamp_(min=0)


def reprefill(model: PreTrainedModel, input_ids: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
              step: int, nxt: torch.Tensor, attn: torch.Tensor,
              fkw: Mapping[str, object]) -> tuple[Any, torch.Tensor]:
    """The live rows' whole context (prompt, tokens 0..step) prefilled again under the model's
    current weights: the old weights' cache would mix both into the next tokens'
    distribution. `attn` already covers the next position. Returns the forward's output and
    the next step's position ids (b, 1)."""
    ctx_ids = torch.cat([input_ids[rows], tokens[rows, : step + 1]], dim=-1)
    ctx_ids[:, -1] = nxt  # a row that ended holds pad in `tokens`; any token does
    full_pos = (attn.cumsum(-1) - 1).clamp_(min=0)
    out = model(input_ids=ctx_ids, attention_mask=attn, position_ids=full_pos, use_cache=True,
                logits_to_keep=1, **fkw)
    return out, full_pos[:, -1:]


def token_versions(gens: Sequence[Generation], switches: Sequence[tuple[int, int]], start: int) -> None:
    """Set `token_versions` on each generation still decoding at the first weight switch
    (step, version): tokens from that step on were sampled by that version's weights."""
    if not switches:
        return
    for g in gens:
        if len(g.response_ids) > switches[0][0]:
            tv = [start] * len(g.response_ids)
            for first, v in switches:
                tv[first:] = [v] * max(len(tv) - first, 0)
            g.token_versions = tv


def finish_generation(
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[int],
    resp: list[int],
    lps: list[float],
    stops: list[str],
    eos_set: set[int],
    version: int,
) -> Generation:
    """Sampled tokens -> `Generation` under the stop-string / EOS rules of `inference/api.py`.

    Shared by every engine, so text, cut point and finish reason never depend on the backend.
    """
    reason: FinishReason = "length"
    body = resp
    if resp and resp[-1] in eos_set:
        reason, body = "eos", resp[:-1]
    text = tokenizer.decode(body, skip_special_tokens=False)
    cut = first_stop(text, stops)
    if cut is not None:
        # Keep the shortest token prefix whose text contains the stop string.
        for k in range(1, len(body) + 1):
            prefix = tokenizer.decode(body[:k], skip_special_tokens=False)
            at = first_stop(prefix, stops)
            if at is not None:
                resp, lps, reason = body[:k], lps[:k], "stop"
                text = prefix[:at]
                break
    return Generation(
        prompt_ids=prompt,
        response_ids=resp,
        text=text,
        logprobs=lps,
        finish_reason=reason,
        version=version,
    )


def first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
