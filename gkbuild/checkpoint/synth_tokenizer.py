"""A small, valid tokenizer for synthesized checkpoints: what ``gkbuild synth`` writes beside the
weights, so text prompts (``gkbuild golden --prompt``) work on any preset without a download.

It is a byte-level BPE (the kind GPT-OSS's o200k_harmony is), built with the ``tokenizers``
library from a short built-in English text, so any text encodes. Its merges are extended
deterministically (pairs of learned tokens, in id order) until the vocabulary fills the preset's
vocabulary up to ``MAX_BPE`` ids: every id a tiny model predicts decodes to text. The harmony
special tokens sit where the real tokenizer has them when the vocabulary is that large, else at
its top (``<|endoftext|>`` and ``<|return|>`` at the config's pad and eos ids). The chat template
renders messages the harmony way: ``<|start|>{role}<|message|>{content}<|end|>``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..model import GptOssConfig

MAX_BPE = 8192  # BPE ids at most; a larger vocabulary keeps its remaining ids without a token
# the harmony specials and their ids in openai/gpt-oss's tokenizer (o200k_harmony)
SPECIALS = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|constrain|>": 200003,
            "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012}
# at the top of a small vocabulary, from the last id down (pad = V-1, eos = V-2, as model.py's config)
SMALL_ORDER = ("<|endoftext|>", "<|return|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
               "<|startoftext|>", "<|constrain|>", "<|call|>")
CHAT_TEMPLATE = ("{%- for message in messages -%}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}"
                 "<|end|>{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")
FILES = ("tokenizer.json", "tokenizer_config.json")
CORPUS = """\
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
A language model reads a prompt one token at a time and predicts the token that comes next.
Once upon a time there was a small village by the sea where the fishermen went out every morning.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
Please write a short poem about the moon, the stars and the quiet of the night.
The weather today is sunny with a light breeze from the west and a few clouds in the afternoon.
In mathematics, a prime number is a natural number greater than one with no divisors but itself and one.
She opened the door, looked at the garden, and smiled because the roses were finally in bloom.
To build the project, install the dependencies, run the tests, and then compile the release.
Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.
The history of computing goes from mechanical calculators to machines with billions of transistors.
He said that he would come back tomorrow, but nobody in the house believed him.
Good morning! How are you today? I hope that you slept well and that your coffee is hot.
The train leaves the station at seven o'clock and arrives in the city two hours later.
Explain in simple words how a neural network learns from examples and from its mistakes.
Numbers like 1, 2, 3, 10, 42, 100 and 2025 appear in text as often as words do.
"""


def vocabulary(cfg: GptOssConfig) -> dict[str, int]:
    """The special tokens' ids for a vocabulary of ``cfg.V``."""
    V = cfg.V
    if V > max(SPECIALS.values()):
        return dict(SPECIALS)
    return {s: V - 1 - k for k, s in enumerate(SMALL_ORDER)}


def build(cfg: GptOssConfig) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json object) for a checkpoint of ``cfg``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = vocabulary(cfg)
    size = min(min(specials.values()), MAX_BPE)  # BPE ids 0..size-1, below every special
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    doc = json.loads(tok.to_str())
    _fill(doc["model"], size)
    doc["model"]["vocab"].update(specials)
    doc["added_tokens"] = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for s, i in sorted(specials.items(), key=lambda x: x[1])]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
              "pad_token": "<|endoftext|>", "model_max_length": cfg.max_position_embeddings,
              "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}
    return json.dumps(doc, ensure_ascii=False), config


def _fill(model: dict, size: int) -> None:
    """More merges, of learned tokens in id order, until ``size`` BPE ids are taken."""
    vocab, merges = model["vocab"], model["merges"]
    tokens = sorted(vocab, key=vocab.get)
    for a in tokens:
        for b in tokens:
            if len(vocab) >= size:
                return
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append([a, b] if not merges or isinstance(merges[0], list) else f"{a} {b}")


def write(cfg: GptOssConfig, folder: Path) -> None:
    """Write the tokenizer files into ``folder``."""
    text, config = build(cfg)
    (Path(folder) / "tokenizer.json").write_text(text, encoding="utf-8")
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
