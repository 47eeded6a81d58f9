"""A small real BPE tokenizer the project builds itself, for tests and CPU runs.

Trained (byte-level BPE, ``tokenizers``) on the docstrings of a fixed list of Python
standard-library modules, so it needs no download and is the same on every machine with
the same Python. It carries a ChatML chat template, like SmolLM2's.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS_MODULES = ("json", "textwrap", "argparse", "collections", "functools", "pathlib", "statistics", "string")


def _corpus() -> list[str]:
    texts = []
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) or inspect.isclass(obj) else None
            if doc:
                texts.append(doc)
    return texts


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 1024) -> Path:
    """Train and save the tokenizer to ``out_dir`` (``tokenizer.json`` + config); returns the path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    fast.chat_template = CHATML_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out
