"""The multi-LoRA operator's backends (``multi_lora``): ``torch_lora.py`` (torch, one ``bmm`` per run of
adapters), ``segment_lora.py`` (segmented GEMMs in Triton, on CUDA) and ``stacking.py`` (adapters of different
ranks stacked into one zero-padded operand)."""
