"""``lorafleet validate WORKLOAD``: load a workload, summarise every task's lengths, and check and describe its data
(``data.describe``: each row read, its format, unused splits, what the chat template adds)."""

from __future__ import annotations

import argparse
import functools

from rich.console import Console
from rich.table import Table

from lorafleet.commands._set_flags import add_set_flag, workload_overrides
from lorafleet.data.describe import check_chat_templates, data_lines
from lorafleet.data.model_source import data_tokenizer
from lorafleet.workload import Workload, load_workload


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("validate", help="check a workload file and summarise its tasks")
    parser.add_argument("workload", help="workload YAML file")
    add_set_flag(parser)
    parser.set_defaults(func=run)


def summary_table(workload: Workload) -> Table:
    """Per task: batch size, context, mean/p50/p99/max length, expected tokens per step, overflow; then totals."""
    table = Table(
        title=f"{workload.path}: {len(workload.tasks)} tasks, model {workload.model.name}, "
        f"{workload.cluster.describe()}"
    )
    for column in ("task", "batch", "context", "mean", "p50", "p99", "max", "tokens/step", "overflow", "policy"):
        table.add_column(column, justify="left" if column in ("task", "policy") else "right")
    for task in workload.tasks:
        d = task.lengths
        table.add_row(
            task.name,
            str(task.batch_size),
            str(task.spec.context_length),
            f"{d.mean:.0f}",
            str(d.quantile(0.5)),
            str(d.quantile(0.99)),
            str(d.max_length),
            f"{task.expected_tokens:,.0f}",
            f"{task.overflow_fraction:.2%}",
            task.spec.overflow.value,
        )
    total_batch = sum(t.batch_size for t in workload.tasks)
    total_tokens = sum(t.expected_tokens for t in workload.tasks)
    table.add_section()
    table.add_row(
        "total",
        str(total_batch),
        "",
        f"{total_tokens / total_batch:.0f}",
        "",
        "",
        str(workload.max_length),
        f"{total_tokens:,.0f}",
        "",
        "",
    )
    return table


def run(args: argparse.Namespace) -> int:
    workload = load_workload(args.workload, workload_overrides(args))
    spec = workload.spec
    tokenizer = functools.cache(lambda: data_tokenizer(spec.model, spec.tokenizer, source=workload.path))
    check_chat_templates(spec.tasks, tokenizer, workload.path)  # chats need a chat template
    # Every task's data is read and checked before anything is printed (its rows, not only its lengths).
    lines = data_lines(spec.tasks, tokenizer)
    Console(width=120).print(summary_table(workload))
    for line in lines:
        print(f"data: {line}")  # plain text: a line may hold brackets that rich would read as markup
    return 0
