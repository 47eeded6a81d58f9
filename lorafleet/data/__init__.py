"""Reading tasks' training data: rows from disk, rendered and tokenized into examples.

readers.py          the containers rows come in: JSONL, JSON arrays, parquet, CSV, .txt, datasets saved by
                    save_to_disk and their splits
formats.py          rows of each format (alpaca, sharegpt, messages, TRL prompt/completion, prompt/response, text)
                    -> a chat, a prompt and response, or a text; ``auto`` detection and the near-miss messages
records.py          a task's rows: read, columns mapped, format resolved, converted (no tokenizer needed)
tokenize.py         rows -> token ids and labels, the loss on what the task produces (each dataset tokenized
                    counts as ``tokenizations``, ``lorafleet.work``); the chat template's default system prompt
describe.py         what ``lorafleet validate`` says of each task's data, a line each
tiny_tokenizer.py   a small real BPE tokenizer the project builds itself, for tests and CPU runs
length_cache.py     tokenized datasets on disk (their examples and lengths), keyed by the data's and tokenizer's
                    bytes: a dataset is tokenized once a machine, and a process that finds it there loads no
                    tokenizer (so no torch)
token_file.py       one cache entry's file: ids, labels and offsets, compact; read back exactly or refused
gguf_metadata.py    where a GGUF file's key-value metadata ends (what keys its tokenizer), from its header
workload_tokens.py  ``WorkloadTokens``: a workload's data -> examples through the cache, the tokenizer loaded
                    only on a miss
model_source.py     where a workload's base model and its tokenizer come from (``model:`` -> ``ModelSource``), and
                    what identifies that tokenizer without loading it (the caches' keys)
tokenizer_cache.py  a workload's tokenizer saved on disk once built (a GGUF's: seconds), read back in ~0.1 s
cache_key.py        where the caches live, and the libraries' versions and source every key holds
weights_index.py    where a model directory's safetensors weights are, from the files' headers (torch-free)
"""
