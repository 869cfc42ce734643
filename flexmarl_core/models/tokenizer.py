"""The shared local tokenizer: a small byte-level BPE trained in ~1 s, no hub access.

Why Qwen2's exact pipeline: in transformers 5, `AutoTokenizer` on a `model_type=qwen2` folder
rebuilds a `Qwen2Tokenizer` with its own NFC normalizer and regex pre-tokenizer and ignores the
ones in `tokenizer.json` (otherwise ids and round trips differ). We train with exactly those (the regex is imported
from transformers, so it cannot drift), hence every loader - ours, `AutoTokenizer`, vLLM - maps
text to the same ids. Byte-level with the full 256-byte alphabet: any string round-trips.

The corpus is generated in code (deterministic): digits, numbers, arithmetic expressions, the
role/format words our prompt templates use, common English words and a little Python.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from flexmarl_core.runfiles.location import default_cache_dir
from storage.atomic import atomic_folder

#: bump when the corpus or the recipe changes, so stale caches are not reused
TOKENIZER_VERSION = 1
DEFAULT_VOCAB_SIZE = 1024

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]  # ids 0, 1, 2

#: ChatML, like Qwen2; the assistant turn ends with <|im_end|>, which is also the EOS token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_FORMAT_WORDS = (
    "plan answer check step steps solve solution verify verified correct incorrect wrong right "
    "final result question problem input output planner solver verifier coder tester critic "
    "judge reviewer agent team round think reason because therefore so first second third then "
    "next finally compute calculate add subtract multiply divide sum difference product quotient "
    "total equals equal is are was yes no true false ok error fix test tests pass fail passed "
    "failed code function return value number numbers digit digits expression evaluate "
    "system user assistant feedback critique revise revised draft explain explanation"
).split()

_ENGLISH_WORDS = (
    "the be to of and a in that have i it for not on with he as you do at this but his by from "
    "they we say her she or an will my one all would there their what up out if about who get "
    "which go me when make can like time just him know take people into year your good some "
    "could them see other than now look only come its over also back after use two how our work "
    "well way even new want any these give day most us has had many more each much must before "
    "same very where why again off every few both here less left keep last long small large "
    "big few start end begin write read find need let try show ask tell call move each "
    "apple apples books cost costs price pay paid buys bought sells sold has have gives gave "
    "more fewer left remaining each per half twice times minutes hours days dollars cents "
    "tom anna sam lisa john mary bob alice eve"
).split()

_PY_SNIPPETS = [
    "def f(x):\n    return x + 1\n",
    "def solve(a, b):\n    return a * b\n",
    "assert f(2) == 3\n",
    "for i in range(10):\n    print(i)\n",
    "if x > 0:\n    y = x\nelse:\n    y = -x\n",
    "result = sum([1, 2, 3])\n",
    "import math\nprint(math.sqrt(16))\n",
]


def _expression(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.3:
        return str(rng.randint(0, 99))
    op = rng.choice("+-*/")
    left, right = _expression(rng, depth - 1), _expression(rng, depth - 1)
    expr = f"{left} {op} {right}"
    return f"({expr})" if rng.random() < 0.3 else expr


def corpus(seed: int = 0, lines: int = 6000) -> Iterator[str]:
    """The deterministic training corpus (a generator of short documents)."""
    rng = random.Random(seed)
    yield " ".join(str(i) for i in range(1000))
    yield "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) . , : ; ? ! # % < > == != <= >= \n\n"
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.35:
            expr = _expression(rng, rng.randint(1, 3))
            try:
                value = eval(expr)  # noqa: S307 - our own generated arithmetic
                answer = str(round(value, 2)) if isinstance(value, float) else str(value)
            except ZeroDivisionError:
                answer = "undefined"
            yield f"question: {expr}\nplan: step 1 compute\nanswer: {expr} = {answer}\n"
        elif kind < 0.6:
            words = rng.choices(_FORMAT_WORDS, k=rng.randint(3, 12))
            role = rng.choice(["plan", "answer", "check", "step", "final answer", "feedback"])
            yield f"{role}: " + " ".join(words) + rng.choice([".", "\n", ":", "?"])
        elif kind < 0.9:
            words = rng.choices(_ENGLISH_WORDS + _FORMAT_WORDS, k=rng.randint(5, 20))
            words[0] = words[0].capitalize()
            yield " ".join(words) + rng.choice([". ", "? ", "!\n", ".\n"])
        else:
            yield rng.choice(_PY_SNIPPETS)
    # Every word also appears with a leading space and capitalised, so each gets merged.
    for w in _FORMAT_WORDS + _ENGLISH_WORDS:
        yield f"{w} {w.capitalize()} {w}: {w}\n"


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE from `corpus(seed)`; deterministic for (vocab_size, seed)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
            f"{256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens)"
        )
    tok = Tokenizer(
        BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    # Exactly what transformers' Qwen2Tokenizer rebuilds (see module docstring).
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def tokenizer_key(vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> str:
    raw = json.dumps({"v": TOKENIZER_VERSION, "vocab": vocab_size, "seed": seed, "re": PRETOKENIZE_REGEX})
    return f"tokenizer-v{TOKENIZER_VERSION}-{vocab_size}-{hashlib.sha256(raw.encode()).hexdigest()[:10]}"


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load a tokenizer folder. With a `tokenizer.json` it is loaded as a plain fast tokenizer,
    so what was saved is what runs (the class is not re-derived from the model type); other
    folders (e.g. sentencepiece-only) go through AutoTokenizer."""
    if (Path(path) / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def get_tokenizer(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> PreTrainedTokenizerBase:
    """The shared local tokenizer, built once and cached under `cache_dir` (see default_cache_dir)."""
    path = default_cache_dir(cache_dir) / tokenizer_key(vocab_size, seed)
    if not (path / "tokenizer.json").exists():
        tok = train_tokenizer(vocab_size, seed)
        with atomic_folder(path) as tmp:  # concurrent workers never see half a folder
            tok.save_pretrained(str(tmp))
    return load_tokenizer(path)
