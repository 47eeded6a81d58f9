"""A profiling replica: a seeded Llama from a ModelSpec with every task's PEFT LoRA adapter.

There is no torch executor yet, so the profiler builds its own replica from public parts:
``transformers.LlamaForCausalLM`` (random weights from a seed, nothing downloaded), sharded
for TP by ``tensor_parallel.shard_block``, then one PEFT LoRA adapter per task. Rows go
through their task's adapter with PEFT's multi-adapter forward (``adapter_names``, one GEMM
pair per task over that task's rows). The profiler gives each micro-batch one task, as
LobRA forms its full micro-batches: on this CPU every further task in a micro-batch adds
about a millisecond per block of small gather, GEMM and scatter calls, a per-task cost
t(b, s) has no term for.

Attention is a variable-length causal kernel (``segment_attention``): a padded micro-batch
attends within each row, a packed one within each sequence of its single row, as
FlashAttention's varlen kernel does on a GPU. The step runs the model's parts explicitly
(embedding, rotary table, blocks, norm, LM head, loss) so that one block, the head or any
pipeline stage can be timed on its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import AttentionInterface, LlamaForCausalLM
from transformers.integrations.sdpa_attention import repeat_kv

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.executor.torch.base_model import llama_config
from lorafleet.profiling.tensor_parallel import shard_block
from lorafleet.specs.model import ModelSpec

ATTENTION = "lorafleet_segments"


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each row, or within each packed sequence when ``cu_seq_lens_q`` is given.

    Shapes: query (B, heads, S, d), key/value (B, kv_heads, S, d) -> (B, S, heads, d).
    """
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    else:
        edges = bounds.tolist()
        out = torch.cat(
            [
                F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling)
                for a, b in zip(edges[:-1], edges[1:])
            ],
            dim=2,
        )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, segment_attention)


@dataclass(frozen=True)
class Batch:
    """Inputs of one micro-batch as the model sees them."""

    input_ids: torch.Tensor
    """(rows, S) token ids."""
    position_ids: torch.Tensor
    """(rows, S), restarting at 0 for every packed sequence."""
    adapter_names: tuple[str, ...]
    """Task (adapter) of every row."""
    cu_seq_lens: torch.Tensor | None
    """Packed sequence boundaries [0, s_1, s_1 + s_2, ...], or None for a padded micro-batch."""

    @property
    def attention_kwargs(self) -> dict:
        return {} if self.cu_seq_lens is None else {"cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens}


class Replica:
    """One TP rank of a replica: the sharded, adapter-carrying model and one optimizer per task."""

    def __init__(
        self,
        spec: ModelSpec,
        adapters: AdapterLoad,
        tp: int = 1,
        rank: int = 0,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
    ) -> None:
        config = llama_config(spec)
        config._attn_implementation = ATTENTION
        torch.manual_seed(seed)
        base = LlamaForCausalLM(config)
        if tp > 1:
            for layer in base.model.layers:
                shard_block(layer.self_attn, layer.mlp, rank, tp, group)
        self.tasks = tuple(f"task{i}" for i in range(adapters.n_tasks))
        model: PeftModel | None = None
        for name, task in zip(self.tasks, adapters.tasks):
            lora = LoraConfig(r=task.rank, lora_alpha=task.rank, target_modules=list(task.targets), lora_dropout=0.0)
            if model is None:
                model = get_peft_model(base, lora, adapter_name=name)
            else:
                model.add_adapter(name, lora)
        self.peft = model
        self.causal_lm: LlamaForCausalLM = model.base_model.model
        self.lora_layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        # Found structurally, through each LoRA layer's per-adapter A and B (not by parameter name).
        self.task_params = {
            name: [p for layer in self.lora_layers for part in (layer.lora_A, layer.lora_B) for p in part[name].parameters()]
            for name in self.tasks
        }
        for params in self.task_params.values():
            for p in params:
                p.requires_grad_(True)
        self.optimizers = [torch.optim.AdamW(params, lr=1e-4) for params in self.task_params.values()]
        self.vocab = spec.vocab

    @property
    def adapter_params(self) -> list[torch.nn.Parameter]:
        return [p for params in self.task_params.values() for p in params]

    @property
    def blocks(self) -> torch.nn.ModuleList:
        return self.causal_lm.model.layers

    def batch(self, mb: MicroBatchShape, generator: torch.Generator, task: int = 0) -> Batch:
        """Random token ids laid out as ``mb``, every row (or the packed row) of task ``task`` (mod tasks)."""
        name = self.tasks[task % len(self.tasks)]
        if mb.padded_len is None:
            lens = list(mb.seq_lens)
            ids = torch.randint(0, self.vocab, (1, sum(lens)), generator=generator)
            pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            return Batch(ids, pos, (name,), cu)
        b, s = mb.n_seqs, mb.padded_len
        ids = torch.randint(0, self.vocab, (b, s), generator=generator)
        return Batch(ids, torch.arange(s).expand(b, s), (name,) * b, None)

    @contextmanager
    def rows_to_adapters(self, batch: Batch) -> Iterator[None]:
        """Route every row through its task's adapter (PEFT's ``adapter_names`` multi-adapter forward)."""

        def inject(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return args, {**kwargs, "adapter_names": list(batch.adapter_names)}

        handles = [layer.register_forward_pre_hook(inject, with_kwargs=True) for layer in self.lora_layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def embed(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Token embeddings (rows, S, h) and the rotary table for the batch's positions."""
        hidden = self.causal_lm.model.embed_tokens(batch.input_ids)
        return hidden, self.causal_lm.model.rotary_emb(hidden, batch.position_ids)

    def run_blocks(
        self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], batch: Batch, blocks: Sequence[int]
    ) -> torch.Tensor:
        """Blocks ``blocks`` in order over ``hidden`` (rows, S, h)."""
        with self.rows_to_adapters(batch):
            for i in blocks:
                hidden = self.blocks[i](
                    hidden, position_ids=batch.position_ids, position_embeddings=rotary, **batch.attention_kwargs
                )
        return hidden

    def head_loss(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Final norm, LM head and next-token cross-entropy (fp32 logits, as transformers computes them)."""
        logits = self.causal_lm.lm_head(self.causal_lm.model.norm(hidden)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.input_ids[:, 1:].reshape(-1))

    def forward_backward(self, batch: Batch) -> None:
        """The whole model's forward and backward on one micro-batch (gradients accumulate)."""
        hidden, rotary = self.embed(batch)
        hidden = self.run_blocks(hidden, rotary, batch, range(len(self.blocks)))
        self.head_loss(hidden, batch).backward()

    def sync_and_step(self, group: dist.ProcessGroup | None) -> None:
        """End of a step: all-reduce every adapter gradient across replicas in one flat buffer (as DDP's
        buckets do) when ``group`` is given, then every task's optimizer step."""
        if group is not None:
            grads = [p.grad for p in self.adapter_params if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

    def prime(self, generator: torch.Generator) -> None:
        """One tiny micro-batch per task and an optimizer step: every adapter now has its gradient
        and its optimizer states, as in any step after the first."""
        for task in range(len(self.tasks)):
            self.forward_backward(self.batch(MicroBatchShape.padded(1, 8), generator, task))
        self.sync_and_step(None)

    def static_bytes(self, blocks: Sequence[int], first: bool, last: bool) -> int:
        """Bytes of the state a pipeline stage holding ``blocks`` keeps: frozen weights, adapters with
        their gradients and optimizer states (after ``prime``, so the states exist)."""
        modules: list[torch.nn.Module] = [self.blocks[i] for i in blocks]
        if first:
            modules.append(self.causal_lm.model.embed_tokens)
        if last:
            modules += [self.causal_lm.model.norm, self.causal_lm.lm_head]
        seen: set[int] = set()
        total = 0
        for module in modules:
            for p in module.parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                total += p.numel() * p.element_size()
                if p.requires_grad:
                    total += p.numel() * p.element_size()  # its gradient
                    for optimizer in self.optimizers:
                        for state in optimizer.state.get(p, {}).values():
                            if torch.is_tensor(state):
                                total += state.numel() * state.element_size()
        return total
