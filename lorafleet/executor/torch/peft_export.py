"""One task's adapter to and from a PEFT adapter directory.

A directory holds ``adapter_config.json`` (a ``peft.LoraConfig``) and
``adapter_model.safetensors``; ``PeftModel.from_pretrained(base, path)`` loads it as is. The names
map one-to-one, with the adapter id dropped on disk as PEFT drops the adapter name:

    in memory: model.layers.0.self_attn.q_proj.lora_A.<id>                   (r, in)
    on disk:   base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight (r, in)

and a DoRA adapter's magnitude (``use_dora: true`` in the config) as PEFT writes it:

    in memory: model.layers.0.self_attn.q_proj.lora_magnitude_vector.<id>            (out,)
    on disk:   base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector (out,)

(no ``.weight``: PEFT's ``LoraModel`` strips it from the magnitude's key when it saves and puts it back when it
loads). A VeRA adapter (``peft_type: VERA``, ``save_projection: true``) is its vectors and, once at the root, the
shared frozen projections (``vera.py``):

    on disk:   base_model.model.model.layers.0.self_attn.q_proj.vera_lambda_d   (r,)     and vera_lambda_b (out,)
               base_model.vera_A (r, max in),  base_model.vera_B (max out, r)  (module "" in the weights' keys)

(``base_model.model.`` is what ``PeftModel`` -> ``LoraModel`` put in front of the base model's
own names.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from lorafleet.errors import InputError
from lorafleet.executor.torch.dora import MAGNITUDE
from lorafleet.executor.torch.inject import module_suffix, multi_lora_layers
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.vera import LAMBDA_B, LAMBDA_D, PROJECTIONS, VECTORS, VeraProjections
from lorafleet.specs.lora import LoraSpec

if TYPE_CHECKING:
    import peft

CONFIG_NAME = "adapter_config.json"
"""An adapter directory's config file (``peft.utils.constants.CONFIG_NAME``). peft itself is imported only
where a config is made or read: importing it costs a worker ~2.5 s of CPU at start-up, and only rank 0 writes."""
SAFETENSORS_WEIGHTS_NAME = "adapter_model.safetensors"
"""An adapter directory's weights file (``peft.utils.constants.SAFETENSORS_WEIGHTS_NAME``)."""

PEFT_PREFIX = "base_model.model."
"""Prefix of every key in a PEFT adapter file, in front of the base model's module name."""

_UNSUPPORTED = {
    "bias": "none",
    "lora_bias": False,
    "fan_in_fan_out": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "exclude_modules": None,
    "modules_to_save": None,
    "target_parameters": None,
}
"""LoraConfig fields lorafleet cannot represent, with the only value it accepts."""

_UNSUPPORTED_VERA = {
    "bias": "none",
    "fan_in_fan_out": False,
    "layers_to_transform": None,
    "modules_to_save": None,
    "init_weights": True,
    "save_projection": True,
}
"""VeraConfig fields lorafleet cannot represent, with the only value it accepts (without ``save_projection`` the
file relies on PEFT redrawing the projections, which PEFT itself warns is not portable)."""

_UNSCALED = (MAGNITUDE, *VECTORS)
"""Factors PEFT keeps as bare parameters, whose keys have no ``.weight``."""


def peft_key(module_name: str, matrix: str) -> str:
    """The on-disk key of ``lora_A``, ``lora_B``, ``lora_magnitude_vector`` or a VeRA vector of a module, or (module
    ``""``) of a VeRA projection (see the module doc)."""
    if not module_name:
        return f"base_model.{matrix}"
    return f"{PEFT_PREFIX}{module_name}.{matrix}" + ("" if matrix in _UNSCALED else ".weight")


def split_peft_key(key: str) -> tuple[str, str]:
    """Inverse of :func:`peft_key`: ``base_model.model.<module>.lora_A.weight`` -> (module, ``lora_A``),
    ``base_model.model.<module>.lora_magnitude_vector`` -> (module, ``lora_magnitude_vector``) and
    ``base_model.vera_A`` -> ("", ``vera_A``)."""
    if not key.startswith(PEFT_PREFIX):
        return "", key.removeprefix("base_model.")
    module, _, factor = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").rpartition(".")
    return module, factor


def lora_config(spec: LoraSpec, *, base_model_name_or_path: str | None = None) -> peft.LoraConfig | peft.VeraConfig:
    """The PEFT config equivalent to ``spec`` (a causal-LM adapter): a ``peft.LoraConfig``, or for VeRA a
    ``peft.VeraConfig`` (its projections saved in the file)."""
    import peft

    if spec.use_vera:
        return peft.VeraConfig(
            r=spec.rank,
            target_modules=list(spec.target_modules),
            projection_prng_key=spec.vera_prng_key,
            save_projection=True,
            vera_dropout=spec.dropout,
            d_initial=spec.vera_d_initial,
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model_name_or_path,
        )
    return peft.LoraConfig(
        r=spec.rank,
        lora_alpha=int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        use_rslora=spec.use_rslora,
        use_dora=spec.use_dora,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )


def write_peft_adapter(
    path: str | Path, spec: LoraSpec, weights: Mapping[tuple[str, str], Tensor], base_model: str | None
) -> None:
    """A PEFT adapter directory from whole matrices, (module, factor) -> matrix (a VeRA adapter's projections under
    module ``""``: :func:`vera_weights`); ``base_model`` is
    its ``base_model_name_or_path``: the Hub id or path a tenant loads it over (``specs.model.adapter_base_model``).

    The config JSON has sorted keys and a sorted ``target_modules`` list, so the same adapter
    always gives the same bytes (``LoraConfig.save_pretrained`` would dump ``target_modules``
    from a set, in hash order). The one writer of the format: :func:`save_peft_adapter` (from an
    injected model) and the checkpoints (``checkpoint.save_train_state``, from gathered pieces) both use it.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {peft_key(module, factor): w.contiguous() for (module, factor), w in sorted(weights.items())}
    save_file(tensors, path / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
    config = lora_config(spec, base_model_name_or_path=base_model).to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_peft_adapter(model: nn.Module, adapter_id: int, path: str | Path) -> Path:
    """Writes adapter ``adapter_id`` of an injected model as a PEFT adapter directory (:func:`write_peft_adapter`;
    its base model is the model config's ``name_or_path``, when it has one).

    Returns:
        The directory.
    """
    layers = [(name, layer) for name, layer in multi_lora_layers(model) if adapter_id in layer.adapters]
    if not layers:
        raise KeyError(f"no injected layer holds adapter {adapter_id}")
    spec = layers[0][1].adapters[adapter_id]
    weights: dict[tuple[str, str], Tensor] = {}
    for name, layer in layers:
        for factor, param in layer.factors(adapter_id).items():
            weights[(name, factor)] = param.detach()
    if spec.use_vera:
        weights.update(vera_weights(layers[0][1].vera_projections[str(adapter_id)]))
    name_or_path = getattr(getattr(model, "config", None), "name_or_path", None) or None
    write_peft_adapter(path, spec, weights, name_or_path)
    return Path(path)


def vera_weights(projections: VeraProjections) -> dict[tuple[str, str], Tensor]:
    """A VeRA adapter's projections as :func:`write_peft_adapter` takes them (module ``""``)."""
    return {("", name): getattr(projections, name).detach() for name in PROJECTIONS}


def _check_unsupported(config: peft.PeftConfig, accepted: Mapping[str, object], config_path: Path) -> None:
    """InputError naming the first field of ``config`` that is not its ``accepted`` value."""
    for field, only in accepted.items():
        value = getattr(config, field, only)
        if (value or None) != (only or None):  # None, False, {} and [] all mean "unused"
            raise InputError(str(config_path), field, f"{value!r} is not supported (only {only!r})")


def _peft_type(config_path: Path) -> str | None:
    """The ``peft_type`` an adapter config names (None when the file does not read: the config class says why)."""
    try:
        return json.loads(config_path.read_text()).get("peft_type")
    except (OSError, ValueError, AttributeError):
        return None


def _read_config(config_class: Any, path: str | Path, kind: str) -> Any:
    """``config_class.from_pretrained(path)`` (PEFT's LoraConfig or VeraConfig); InputError naming the file when it
    cannot be read as a ``kind`` adapter's config."""
    try:
        return config_class.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as err:
        raise InputError(str(Path(path) / CONFIG_NAME), "", f"not a readable {kind} adapter config: {err}") from err


def _spec_of(config: Any, unsupported: Any, config_path: Path, **fields: Any) -> LoraSpec:
    """The :class:`LoraSpec` of a read PEFT ``config``: its rank and listed target modules with ``fields``, after the
    options lorafleet cannot run (``unsupported``) and a regex of targets are refused; InputError naming the field
    the spec refuses."""
    _check_unsupported(config, unsupported, config_path)
    if isinstance(config.target_modules, str):
        raise InputError(str(config_path), "target_modules", "a regex is not supported; list module names")
    try:
        return LoraSpec(rank=config.r, target_modules=tuple(sorted(config.target_modules)), **fields)
    except ValidationError as err:
        first = err.errors()[0]
        raise InputError(str(config_path), ".".join(map(str, first["loc"])), first["msg"]) from err


def read_peft_spec(path: str | Path) -> LoraSpec:
    """The :class:`LoraSpec` of a PEFT adapter directory (LoRA, DoRA or VeRA); InputError for what lorafleet cannot
    run."""
    import peft

    config_path = Path(path) / CONFIG_NAME
    if _peft_type(config_path) == peft.PeftType.VERA:
        config = _read_config(peft.VeraConfig, path, "VeRA")
        return _spec_of(
            config,
            _UNSUPPORTED_VERA,
            config_path,
            dropout=config.vera_dropout,
            use_vera=True,
            vera_prng_key=config.projection_prng_key,
            vera_d_initial=config.d_initial,
        )
    config = _read_config(peft.LoraConfig, path, "LoRA")
    if config.peft_type != peft.PeftType.LORA:
        message = f"{config.peft_type}: only LORA and VERA adapters are supported"
        raise InputError(str(config_path), "peft_type", message)
    return _spec_of(
        config,
        _UNSUPPORTED,
        config_path,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout,
        use_rslora=config.use_rslora,
        use_dora=bool(config.use_dora),
    )


def load_peft_adapter(model: nn.Module, path: str | Path, adapter_id: int) -> LoraSpec:
    """Loads a PEFT adapter directory into task slot ``adapter_id`` of an injected model.

    The slot takes the file's rank, alpha, dropout and targets, replacing whatever it held; it
    is removed from injected layers the file does not target. The model is changed only after
    the whole file has been checked.

    Returns:
        The loaded adapter's spec.

    Raises:
        InputError: the config is unsupported, a targeted layer is missing from the file or the
            model, or a weight has the wrong shape.
    """
    spec = read_peft_spec(path)
    weights_path = Path(path) / SAFETENSORS_WEIGHTS_NAME
    state = load_file(str(weights_path))
    projections = _projections_of(state, spec, weights_path)
    updates: list[tuple[MultiLoraLinear, list[Tensor] | None]] = []
    for name, layer in multi_lora_layers(model):
        if module_suffix(name) not in spec.target_modules:
            updates.append((layer, None))
            continue
        shapes = {"lora_A": (spec.rank, layer.in_features), "lora_B": (layer.out_features, spec.rank)}
        if spec.use_dora:
            shapes[MAGNITUDE] = (layer.out_features,)
        if spec.use_vera:
            shapes = {LAMBDA_D: (spec.rank,), LAMBDA_B: (layer.out_features,)}
        found = []
        for matrix, shape in shapes.items():
            key = peft_key(name, matrix)
            if key not in state:
                raise InputError(str(weights_path), key, "missing for a targeted layer of this model")
            if tuple(state[key].shape) != shape:
                raise InputError(str(weights_path), key, f"shape {tuple(state[key].shape)}, the model needs {shape}")
            found.append(state.pop(key))
        updates.append((layer, found))
    if state:
        raise InputError(str(weights_path), next(iter(state)), "matches no injected layer of this model")
    for layer, found in updates:
        if found is None:
            layer.remove_adapter(adapter_id)
        else:
            magnitude = found[2] if spec.use_dora else None
            layer.add_adapter(adapter_id, spec, (found[0], found[1]), magnitude, projections)
    return spec


def _projections_of(state: dict[str, Tensor], spec: LoraSpec, weights_path: Path) -> VeraProjections | None:
    """A VeRA file's projections, taken out of ``state`` (None for another kind); InputError when missing."""
    if not spec.use_vera:
        return None
    keys = [peft_key("", name) for name in PROJECTIONS]
    for key in keys:
        if key not in state:
            raise InputError(str(weights_path), key, "missing: lorafleet reads VeRA files saved with their projections")
    A, B = (state.pop(key) for key in keys)
    if A.shape[0] != spec.rank or B.shape[1] != spec.rank:
        raise InputError(str(weights_path), keys[0], f"rank {A.shape[0]}, the config's r is {spec.rank}")
    return VeraProjections(A, B)
