"""Constrained decoding for `sampling.json_schema` on the HF engine: before each token is drawn,
every token that cannot continue an answer following the schema gets probability zero.

The allowed tokens come from lm-format-enforcer (a character-level JSON-schema parser walked
over a prefix tree of the vocabulary), the library vLLM also offers as a structured-output
backend; vLLM's own engine uses its structured outputs instead (`vllm_engine.py`). The
behaviour log-probs are those of the distribution actually sampled: the model's, renormalised
over the allowed tokens (the trainer's policy ratio is taken against them)."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

import torch

_DATA: dict[int, Any] = {}
_LOCK = threading.Lock()


def _tokenizer_data(tokenizer: Any, eos_ids: Sequence[int]) -> Any:
    """lm-format-enforcer's view of a vocabulary: built once per tokenizer (a pass over it)."""
    from lmformatenforcer.tokenenforcer import TokenEnforcerTokenizerData

    with _LOCK:
        key = id(tokenizer)
        if key not in _DATA:
            special = set(tokenizer.all_special_ids)
            zero = tokenizer.encode("0", add_special_tokens=False)[-1]
            regular = []
            for i in range(len(tokenizer)):
                if i in special:
                    continue
                # after a "0" a word-start token decodes with its leading space, alone it may not
                after = tokenizer.decode([zero, i])[1:]
                if "\ufffd" in after or any(ord(c) < 32 and c not in "\t\n\r" for c in after):
                    continue  # part of a multi-byte character, or a control character: never in JSON text
                regular.append((i, after, len(after) > len(tokenizer.decode([i]))))

            def decode(ids: list[int]) -> str:
                return tokenizer.decode(ids).rstrip("\ufffd")  # an unfinished multi-byte character
            _DATA[key] = (tokenizer, TokenEnforcerTokenizerData(regular, decode, list(eos_ids), False, len(tokenizer)))
        return _DATA[key][1]


@functools.lru_cache(maxsize=64)
def _parser(schema: str) -> Any:
    from lmformatenforcer import JsonSchemaParser
    from lmformatenforcer.characterlevelparser import CharacterLevelParserConfig

    # At most 2 whitespace characters in a row (the library allows 12): compact JSON, as OpenAI
    # returns it. With 12, a model that has not learned the format spends most of its tokens
    # on the whitespace allowed between every two tokens and runs past max_new_tokens.
    return JsonSchemaParser(json.loads(schema), CharacterLevelParserConfig(max_consecutive_whitespaces=2))


class RowConstraints:
    """The rows of one decode whose request has a `json_schema`: each its own enforcer."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int], schemas: Sequence[dict[str, Any] | None],
                 prompt_ids: Sequence[Sequence[int]]) -> None:
        from lmformatenforcer import TokenEnforcer

        data = _tokenizer_data(tokenizer, eos_ids)
        self.eos = list(eos_ids)
        self.prompts = prompt_ids
        self.enforcers = [None if s is None else TokenEnforcer(data, _parser(json.dumps(s, sort_keys=True)))
                          for s in schemas]

    def __bool__(self) -> bool:
        return any(e is not None for e in self.enforcers)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
              done: torch.Tensor) -> None:
        """Mask, in place, the (b, V) logits of the batch's rows (`rows`: their indices into all
        rows) to the tokens each constrained row may write next."""
        ended = done.tolist()
        for b, r in enumerate(rows.tolist()):
            enforcer = self.enforcers[r]
            if enforcer is None or ended[r]:
                continue
            seq = [*self.prompts[r], *tokens[r, : int(lengths[r])].tolist()]
            allowed = list(enforcer.get_allowed_tokens(seq).allowed_tokens) or self.eos
            keep = logits[b, allowed].clone()
            logits[b].fill_(float("-inf"))
            logits[b, allowed] = keep
