"""Put :class:`MultiLoraLinear` into a transformers causal LM, PEFT-style.

``inject_multi_lora`` follows PEFT's ``inject_adapter``: match module names by suffix against the
adapters' ``target_modules``, ``setattr`` the wrapper on the parent (the original linear becomes its
``base_layer``). Every base parameter is frozen; adapter weights are created trainable and are
found *structurally*, by visiting the wrappers (:func:`adapter_parameters`), never by a name
prefix such as ``lora_`` (a base module whose name contains the prefix would be mistaken for an
adapter). Works for every supported family's decoder layers (``specs.architecture``), GQA included: k/v
projections are just narrower linears, and a fused one (Phi-3's ``qkv_proj``) one wider linear, whose adapter is
one ``A`` and one ``B`` as PEFT's. The targets are the model's own names: a workload's list is mapped onto them
first (``specs.architecture.model_targets``, by the executor).

A model whose base weights are on the ``meta`` device (the skeleton of per-stage loading, see
``replica.py``) gets real adapters on the host (``MultiLoraLinear.add_adapter``), drawn from the
generator exactly as over a real host model.

**One draw rule** (:func:`initial_lora_A`): a seeded adapter's ``A`` matrices are drawn from the shapes of
the whole model's projections (:func:`projection_shapes`), not from the modules at hand, so a stage that
holds a few layers (a task added to a running fleet, ``change.py``) draws the same matrices as an
injection into the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from lorafleet.executor.torch.multi_lora import MultiLoraLinear, adapter_dtype
from lorafleet.executor.torch.routing import LoraBackend, Segments
from lorafleet.executor.torch.vera import VeraProjections, shared_projections
from lorafleet.specs.lora import TARGET_MODULES, LoraSpec


def module_suffix(name: str) -> str:
    """The last component of a dotted module name: ``model.layers.0.self_attn.q_proj`` -> ``q_proj``."""
    return name.rpartition(".")[2]


def projection_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every projection an adapter may target (``specs.lora.TARGET_MODULES``) of a whole model, not yet
    split: name -> ``(in_features, out_features)``, in model order (an injected one is read through its
    ``base_layer``, so call it before TP slices the model)."""
    shapes = {}
    for name, module in model.named_modules():
        if module_suffix(name) in TARGET_MODULES:
            linear = module.base_layer if isinstance(module, MultiLoraLinear) else module
            shapes[name] = (linear.in_features, linear.out_features)
    return shapes


def initial_lora_A(
    shapes: dict[str, tuple[int, int]], spec: LoraSpec, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Adapter ``spec``'s initial ``A (r, in)`` of every projection it targets in ``shapes`` (model order), on
    the host in ``dtype``: Kaiming-uniform (a = sqrt(5)) as PEFT draws it, from a generator seeded with ``seed``
    alone, one matrix after the other (the global generator is left as it was). ``B`` starts at zero. A VeRA
    adapter draws nothing here (its start does not depend on the seed: :func:`vera_projections`)."""
    out: dict[str, torch.Tensor] = {}
    if spec.use_vera:
        return out
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, (in_features, _) in shapes.items():
            if module_suffix(name) in spec.target_modules:
                out[name] = nn.init.kaiming_uniform_(torch.empty(spec.rank, in_features, dtype=dtype), a=math.sqrt(5))
    return out


def vera_projections(shapes: dict[str, tuple[int, int]], spec: LoraSpec) -> VeraProjections | None:
    """A VeRA adapter's shared frozen projections over the whole model's ``shapes`` (``vera.shared_projections``);
    None for any other kind."""
    return shared_projections(shapes, spec.target_modules, spec.rank, spec.vera_prng_key) if spec.use_vera else None


def inject_multi_lora(
    model: nn.Module,
    adapters: Sequence[LoraSpec],
    *,
    backend: LoraBackend = LoraBackend.AUTO,
    seeds: Sequence[int] | None = None,
) -> list[str]:
    """Wraps every targeted linear of ``model`` in place; adapter id ``i`` is ``adapters[i]``.

    A module is wrapped when its name's suffix is in some adapter's ``target_modules``; adapter
    ``i`` is added only where its own targets match. Every other parameter of the model is frozen.
    With ``seeds``, adapter ``i``'s initial weights are drawn, layer by layer in model order, from a
    generator seeded with ``seeds[i]`` alone (the global one is left as it was): an adapter starts the
    same whichever adapters are injected beside it. Without, all are drawn from the global generator.

    Returns:
        The names of the wrapped modules, in model order.

    Raises:
        TypeError: a targeted module is not an ``nn.Linear`` (or the model is already injected).
        ValueError: no module matches any target.
    """
    targets = {t for spec in adapters for t in spec.target_modules}
    names = [name for name, _ in model.named_modules() if module_suffix(name) in targets]
    if not names:
        raise ValueError(f"no module of {type(model).__name__} matches target_modules {sorted(targets)}")
    if seeds is not None and len(seeds) != len(adapters):
        raise ValueError(f"{len(adapters)} adapters but {len(seeds)} seeds")
    shapes = projection_shapes(model)
    projections = [vera_projections(shapes, spec) for spec in adapters]
    model.requires_grad_(False)
    layers = []
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        original = getattr(parent, child)
        # A new module starts in training mode; keep the model's mode (dropout off in eval).
        layer = MultiLoraLinear(original, backend=backend).train(original.training)
        for adapter_id, spec in enumerate(adapters):
            if child in spec.target_modules and (seeds is None or spec.use_vera):
                layer.add_adapter(adapter_id, spec, projections=projections[adapter_id])
        setattr(parent, child, layer)
        layers.append((name, layer))
    for adapter_id, (spec, seed) in enumerate(zip(adapters, seeds or (), strict=False)):  # a DoRA m: ||W||_c
        dtype = adapter_dtype(next(layer for _, layer in layers).base_layer.weight.dtype)
        drawn = initial_lora_A(shapes, spec, seed, dtype)
        for name, layer in layers:
            if name in drawn:
                layer.add_adapter(adapter_id, spec, (drawn[name], torch.zeros(layer.out_features, spec.rank)))
    return names


def multi_lora_layers(model: nn.Module) -> Iterator[tuple[str, MultiLoraLinear]]:
    """``(name, layer)`` for every :class:`MultiLoraLinear` in ``model``, in model order."""
    for name, module in model.named_modules():
        if isinstance(module, MultiLoraLinear):
            yield name, module


def adapter_parameters(model: nn.Module, adapter_id: int | None = None) -> Iterator[nn.Parameter]:
    """The LoRA weights of one adapter (or of all), found by visiting the wrappers: per layer ``A``, ``B`` and a
    DoRA adapter's magnitude.

    Use it for per-task optimizers: ``AdamW(adapter_parameters(model, task), lr=...)``.
    """
    for _, layer in multi_lora_layers(model):
        for a in list(layer.adapters):
            if adapter_id is None or a == adapter_id:
                yield from layer.factors(a).values()


@contextmanager
def segments_context(model: nn.Module, segments: Segments) -> Iterator[None]:
    """Routes the rows of every injected layer by ``segments`` for the forwards inside the block.

    The rows are the model's tokens flattened batch-major, ``(B, S) -> B * S``, which is how
    every projection sees its input. The backward needs no segments: each layer's autograd node
    keeps its own. The previous segments are restored on exit, so contexts nest.

    Example:
        >>> with segments_context(model, Segments.padded([0, 2], lengths=[7, 5], seq_len=8)):
        ...     loss = model(input_ids, attention_mask=mask).logits.sum()
        >>> loss.backward()
    """
    layers = [layer for _, layer in multi_lora_layers(model)]
    previous = [layer.segments for layer in layers]
    for layer in layers:
        layer.segments = segments
    try:
        yield
    finally:
        for layer, old in zip(layers, previous, strict=True):
            layer.segments = old
