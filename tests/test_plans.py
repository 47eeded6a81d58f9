"""The typed objects between stages: what a StepPlan counts of its own tokens."""

from __future__ import annotations

from lorafleet.plans import MicroBatch, ReplicaWork, StepPlan


def test_task_token_counts_are_real_and_padding_tokens_per_task_name():
    padded = MicroBatch(seq_ids=(0, 1), task_ids=(0, 2), lengths=(5, 3), padded_len=8)
    packed = MicroBatch(seq_ids=(2,), task_ids=(2,), lengths=(4,), padded_len=None)
    step_plan = StepPlan(
        step=0,
        bucket_boundaries=(8,),
        work=(ReplicaWork(0, (padded,), 1.0), ReplicaWork(1, (packed,), 0.5), ReplicaWork(2, (), 0.0)),
        estimated_makespan_s=1.0,
    )
    tokens, padding = step_plan.task_token_counts(("a", "idle", "b"))
    assert tokens == {"a": 5, "idle": 0, "b": 7} and padding == {"a": 3, "idle": 0, "b": 5}
    assert list(tokens) == ["a", "idle", "b"]  # every name, in order
    assert sum(tokens.values()) == step_plan.tokens and sum(padding.values()) == step_plan.padding_tokens
