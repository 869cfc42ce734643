"""A trained team taken out of its run: which weight versions a run keeps and may be read
(`versions.py`), each agent's model at a version, LoRA adapters merged (`weights.py`), written as
a Hugging Face folder with its tokenizer, chat template, generation config and model card
(`folder.py`, `card.py`)."""
