"""Typed, validated inputs (pydantic, on ``_base.py``'s base), torch-free, and the rules for reading and writing
lorafleet's files.

- a workload: ``workload.py`` (the tasks; one rule each for relative paths and sequences over the context
  length), ``names.py`` (the one rule for a task's name), ``sweep.py`` (a task's hyperparameter sweep and the
  member tasks it expands into), ``data.py (where a task's rows come from), ``evaluation.py`` (its ``eval`` and
  ``early_stopping``), ``loss_curve.py`` (its ``eval.curve``, for what-ifs), ``model.py`` (base-model
  dimensions), ``architecture.py`` (the model families trained; a LoRA target list on each), ``gpus.py``
  (datasheets), ``cluster.py`` (pools of nodes), ``lora.py`` (adapter and optimizer settings), ``recompute.py``;
- length distributions: ``lengths.py`` (``LengthDistribution``), ``length_family.py`` (the parametric
  family and its fit), ``length_presets.py`` (LobRA's twelve datasets offline);
- policies and settings: ``dispatch.py`` (the dispatch policy and its field table), ``objective.py`` (the
  planner's objective a plan records), ``fields.py`` (a settings dataclass's field table: flag, doc, default,
  bounds), ``replan.py`` (``ReplanSettings``), ``device.py`` (``Device``, ``Precision``), ``solver.py``
  (the MILP back ends one may name);
- other files: ``trace.py`` (an arrivals trace);
- typed files: ``typed.py`` (strict validation naming the field path), ``io.py`` (JSON read with one-line
  errors, the one atomic writer of a file or a directory, a file's SHA-256); ``hints.py`` ("did you mean" for
  an unknown key: other tools' names, typos); ``field_docs.py`` (a field's attribute doc string: its JSON Schema
  description and its flag's help, read when asked for).
"""
