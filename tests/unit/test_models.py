"""Model factory: local tokenizer (round trips, Qwen2 loader trap), presets, save/load, cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from flexmarl_core.config import PRESET_NAMES, ModelConfig
from flexmarl_core.models import (
    PRESETS,
    build_model,
    load_agent_model,
    load_model,
    load_tokenizer,
    num_params,
    preset_config,
    save_model,
    train_tokenizer,
)
from flexmarl_core.models.factory import base_model_dir
from tests._models_util import assert_same_tensors, cache_dir, tiny_model, tokenizer

TEXTS = [
    "question: 12 + 345 * (6 - 7) = ?\nplan: step 1 compute\nanswer: -333",
    "Check the answer. It is correct!\n\n\nfinal answer: 42",
    "  leading spaces, trailing spaces  \t tab\r\nwindows line",
    "unicode: héllo wörld, 日本語, emoji 🙂, combining e\u0301",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def test_tokenizer_round_trip_and_size():
    tok = tokenizer()
    assert 512 <= len(tok) <= 2048
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for text in TEXTS[:-1]:
        ids = tok.encode(text, add_special_tokens=False)
        # NFC normalisation is part of Qwen2's pipeline: e + combining accent comes back as é.
        import unicodedata

        assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    # Special tokens are single ids; common words are single tokens (the corpus did its job).
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == tok.convert_tokens_to_ids("<|im_start|>")
    for word in ["plan", " answer", " check", " step", "\n"]:
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word


def test_tokenizer_is_deterministic():
    a, b = train_tokenizer(), train_tokenizer()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_saved_tokenizer_ids_identical_under_every_loader(tmp_path):
    """The FACTS trap: AutoTokenizer on a qwen2 folder rebuilds Qwen2Tokenizer's pipeline."""
    tok = tokenizer()
    save_model(tiny_model(), tok, tmp_path)
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    plain = load_tokenizer(tmp_path)
    assert type(auto).__name__ == "Qwen2Tokenizer"  # the rebuilt class really is in play
    for text in TEXTS:
        ref = tok.encode(text, add_special_tokens=False)
        assert auto.encode(text, add_special_tokens=False) == ref
        assert plain.encode(text, add_special_tokens=False) == ref
    chat = [{"role": "user", "content": "1 + 1"}]
    assert auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\n1 + 1<|im_end|>\n<|im_start|>assistant\n"
    )
    assert auto.eos_token_id == tok.eos_token_id and auto.pad_token_id == tok.pad_token_id


def test_build_is_deterministic_and_leaves_global_rng():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = tiny_model(0), tiny_model(0), tiny_model(1)
    assert torch.equal(torch.get_rng_state(), before)
    assert_same_tensors(a.state_dict(), b.state_dict())
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert 0.9e6 < num_params(a) < 1.3e6


@pytest.mark.parametrize(("preset", "lo", "hi"), [("tiny-10m", 8e6, 12e6), ("tiny-50m", 40e6, 55e6),
                                                  ("small-0.5b", 490e6, 500e6)])
def test_preset_sizes(preset, lo, hi):
    with torch.device("meta"):  # shapes only, no memory or init time
        model = Qwen2ForCausalLM(preset_config(preset, tokenizer()))
    assert lo < num_params(model) < hi


def test_the_real_size_preset_has_qwen25_05bs_shape_and_a_padded_vocabulary():
    c = preset_config("small-0.5b", tokenizer())
    assert (c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.num_attention_heads,
            c.num_key_value_heads, c.vocab_size, c.tie_word_embeddings) == (896, 24, 4864, 14, 2, 151_936, True)
    # Rows past the tokenizer's are never produced by it and decode to nothing, as padded rows do.
    assert len(tokenizer()) < c.vocab_size and tokenizer().decode([150_000]) == ""


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match="tiny-1m"):  # the config refuses it at load
        ModelConfig(preset="huge")
    with pytest.raises(ValueError, match="tiny-1m"):  # and the factory, for unvalidated input
        preset_config("huge", tokenizer())
    # The config names the presets without importing torch: the same names as the factory.
    assert set(PRESETS) == set(PRESET_NAMES) == {"tiny-1m", "tiny-10m", "tiny-50m", "small-0.5b"}


def test_save_load_round_trip(tmp_path):
    tok, model = tokenizer(), tiny_model(3)
    save_model(model, tok, tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded, tok2 = load_model(tmp_path)
    assert_same_tensors(model.state_dict(), loaded.state_dict())
    ids = torch.tensor([tok.encode(TEXTS[0])])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert tok2.encode(TEXTS[0]) == tok.encode(TEXTS[0])


def test_load_agent_model_caches_preset_and_loads_path(tmp_path):
    cfg = ModelConfig(preset="tiny-1m")
    model, tok = load_agent_model(cfg, seed=5, cache_dir=cache_dir())
    assert (base_model_dir("tiny-1m", 5, cache_dir()) / "model.safetensors").exists()
    assert_same_tensors(model.state_dict(), build_model(cfg, seed=5, tokenizer=tok).state_dict())
    again, _ = load_agent_model(cfg, seed=5, cache_dir=cache_dir())  # from the cache
    assert_same_tensors(model.state_dict(), again.state_dict())
    save_model(model, tok, tmp_path / "m")
    from_path, _ = load_agent_model(ModelConfig(path=str(tmp_path / "m")), seed=0)
    assert_same_tensors(model.state_dict(), from_path.state_dict())
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path / "nothing")
