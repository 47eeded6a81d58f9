"""Reading tasks' training data: rows from disk, rendered and tokenized into examples.

records.py          a task's rows, from a JSONL file or a ``datasets.save_to_disk`` directory
tokenize.py         rows -> token ids and labels, the loss on response tokens only (each dataset tokenized
                    counts as ``tokenizations``, ``lorafleet.work``)
tiny_tokenizer.py   a small real BPE tokenizer the project builds itself, for tests and CPU runs
model_source.py     where a workload's base model and its tokenizer come from (``model:`` -> ``ModelSource``)
weights_index.py    where a model directory's safetensors weights are, from the files' headers (torch-free)
"""
