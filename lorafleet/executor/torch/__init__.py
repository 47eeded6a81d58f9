"""The torch executor: real replicas of a deployment plan, one process a rank, each running its share of every
step's StepPlan (docs/train.md, docs/multi_lora.md, docs/pipeline.md). Only ranks import it; what the launcher
and these ranks share without torch is ``lorafleet.runtime``'s.

- process start-up: ``launch.py`` (``init_distributed``, ``check_device_kinds``, ``build_torch_executor``);
- the executor: ``worker.py`` (``TorchExecutor``: rank 0 coordinates, the others serve), a window of steps in
  ``window.py`` (``WindowRunner``), its checkpoints in ``checkpointer.py`` (``Checkpointer``), a change of its
  tasks or deployment at a step boundary in ``change.py`` (``FleetChange``, ``change_fleet``), an evaluation
  (held-out rows, forward only) in ``evaluate.py``;
- a replica: ``replica.py`` (``build_replica``: this rank's stage), ``groups.py`` (``GroupCache``), ``tp.py``
  (Megatron TP), ``pipeline.py`` (stages, a 1F1B stream);
- one rank's window: ``step.py`` (inputs, stage forward, per-task loss), ``attention.py`` (causal inside each
  packed sequence), ``grad_sync.py`` (``GradSync``), ``updates.py`` (``TaskUpdates``), ``optim.py``
  (``TaskOptimizer``);
- the multi-LoRA operator: ``multi_lora.py`` (``MultiLoraLinear``), ``routing.py`` (``LoraRouting``),
  ``dropout.py`` (the keep-mask, drawn again in the backward), ``mask_memory.py`` (where it is kept instead),
  ``token_split.py`` (a column-parallel input's rows kept per TP rank for the A gradient), its backends in
  ``kernels/``, ``inject.py`` (the operator put into a model), ``dora.py`` (DoRA's magnitude), ``vera.py`` (VeRA's
  shared projections and vectors), ``quant.py`` (NF4 and int8 storage of a frozen base), ``quantized_base.py``
  (``QuantizedLinear``) and ``quantized_stage.py`` (a quantized base loaded whole or per stage);
- the base model and files: ``base_model.py`` (``load_base``), ``families.py`` (what a model family's own forward
  adds around its layers: Gemma 3's rotary tables, Gemma 2's logit soft cap), ``fused.py`` (Phi-3's fused
  projections under TP, part by part), ``checkpoint.py`` (a checkpoint's tensors,
  committed atomically), ``peft_export.py`` (a PEFT adapter directory);
- odds and ends: ``precision.py`` (``torch_dtype``), ``transfer.py`` (host-to-device copies that do not stall
  the host).
"""
