"""A workload's data as tokenized examples, through the token cache, its tokenizer loaded only when it must be.

A :class:`WorkloadTokens` is what a training process tokenizes with: the workload's fields that name its
tokenizer (``model``, ``tokenizer``: what a cache key holds, ``data.length_cache``) and the tokenizer itself,
loaded at its first use, once (``data.model_source.data_tokenizer``). A dataset tokenized before on this
machine, by the launcher, ``plan``, another rank or an earlier run, is read from the cache and no tokenizer is
loaded for it; a rank that finds every task's data there loads none (rank 0 loads it for the run's exports).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from lorafleet.data.length_cache import cached_examples
from lorafleet.data.tokenize import Example, tokenize_data
from lorafleet.specs.data import DataSpec


class WorkloadTokens:
    """Examples of a workload's datasets (the module doc); thread-safe (a joining task's data is prepared beside
    the steps: ``train.joining``)."""

    def __init__(self, load: Callable[[], Any], model: str | None = None, tokenizer: str | None = None) -> None:
        """
        Args:
            load: the workload's tokenizer (called once, at the first use; it returns the same object ever after).
            model, tokenizer: the workload's fields that name it; ``model`` None: nothing names it (a tokenizer
                passed on its own), so no example is cached.
        """
        self._load, self._loaded, self._lock = load, None, threading.Lock()
        self.model, self.tokenizer_field = model, tokenizer

    @classmethod
    def of(cls, tokenizer: Any) -> WorkloadTokens:
        """A tokenizer already loaded and named by nothing (``model`` None): tokenizes every time."""
        return tokenizer if isinstance(tokenizer, WorkloadTokens) else cls(lambda: tokenizer)

    def tokenizer(self) -> Any:
        """The tokenizer, loaded at the first call."""
        with self._lock:
            if self._loaded is None:
                self._loaded = self._load()
            return self._loaded

    def examples(self, data: DataSpec) -> list[Example]:
        """``data``'s rows tokenized (``data.tokenize.tokenize_data``), or the cache's copy of them."""
        if self.model is None:
            return tokenize_data(self.tokenizer(), data)
        return cached_examples(data, self.model, self.tokenizer_field, lambda: tokenize_data(self.tokenizer(), data))
