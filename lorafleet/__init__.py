"""lorafleet: plan, simulate and train many LoRA adapters on a heterogeneous fleet."""

__version__ = "0.1.0"
