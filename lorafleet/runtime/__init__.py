"""The torch-free pieces of a training run that both the launcher (``lorafleet.train``) and the ranks'
executor (``lorafleet.executor.torch``) use. Nothing here imports torch, so ``lorafleet train`` checks a run
(its data, its checkpoints, its processes) before any worker starts.

- ``processes.py``: how workers start (torchrun's argv, their environment, parent death, stop signals);
- ``data_stream.py``: each task's examples as a deterministic, resumable stream (``DataStreams``,
  ``training_streams``, ``task_tokenizer``), and ``eval_split.py``: a task's held-out rows;
- ``checkpoint_files.py``: what a committed checkpoint is on disk, the newest intact one, the adapters'
  export (``step_dir_name``, ``resumable_checkpoint``, ``export_adapters``), and ``base_quantization.py``: the
  quantized base a checkpoint records, what a resume and a launch check of it, and the card's words;
- ``layout.py``: degree arithmetic (which rank holds which replica, stage, TP shard and layers);
- ``host_memory.py``: a CPU rank keeps its freed heap between steps;
- ``gc_policy.py``: how often every command and every rank runs the cyclic garbage collector.
"""
