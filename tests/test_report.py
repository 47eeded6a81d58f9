"""The HTML report: what ran on what, and its numbers formatted one way (issue #17)."""

from __future__ import annotations

import json
import re

import pytest

from lorafleet.assemble import workload_cluster
from lorafleet.cli import main
from lorafleet.report import format_value, summary_rows, task_cost_rows, write_report
from lorafleet.simulate import simulate_schedule
from tests.helpers.repo import EXAMPLES


@pytest.fixture(scope="module")
def report(small, tmp_path_factory):
    workload, _, result = small
    cluster = workload_cluster(workload)
    runs = [simulate_schedule(workload, s, result.cost_model, 3) for s in (result.schedule, *result.baselines)]
    plan_rows = [{"replica": 0, "config": "<1,1>", "gpus": "0", "max_tokens": 12345, "expected_s": 1.23456}]
    out = tmp_path_factory.mktemp("report")
    page = write_report(out, workload, runs, plan_rows, cluster=cluster, cost_source=result.cost_model.source)
    return runs, result.cost_model.source, page.read_text(), out


def _cells(page: str, heading: str) -> list[list[str]]:
    """The rows of the table after ``<h2>heading``, as cell texts (header row first)."""
    table = page.split(f"<h2>{heading}", 1)[1].split("<table>", 1)[1].split("</table>", 1)[0]
    return [re.findall(r"<t[hd]>(.*?)</t[hd]>", row) for row in table.split("</tr>") if "<t" in row]


def test_the_heading_names_the_gpus_and_the_cost_model(report):
    runs, source, page, _ = report
    assert source == "analytic:A100-80GB"
    summary = page.split("<h2>", 1)[0]
    assert "8 x A100-80GB" in summary and "cost model analytic:A100-80GB" in summary
    assert "8 x A100-80GB" in page.split("</title>", 1)[0]


def test_saved_by_lorafleet_is_a_percentage(report):
    runs, _, page, _ = report
    head, *rows = _cells(page, "Methods")
    column = head.index("saved_by_lorafleet")
    expected = [f"{100 * r['saved_by_lorafleet']:.1f} %" for r in summary_rows(runs)]
    assert [row[column] for row in rows] == expected
    assert expected[0] == "0.0 %" and all(re.fullmatch(r"-?\d+\.\d %", e) for e in expected)


def test_report_numbers_are_formatted_one_way(report):
    runs, _, page, _ = report
    head, *rows = _cells(page, "Methods")
    for row, summary in zip(rows, summary_rows(runs), strict=True):
        cells = dict(zip(head, row, strict=True))
        for seconds in ("mean_step_s", "p95_step_s", "gpu_s_per_step"):
            assert cells[seconds] == f"{summary[seconds]:,.3f}"
        for share in ("utilisation", "padding_ratio"):
            assert cells[share] == f"{100 * summary[share]:.1f} %"
        assert cells["gpus"] == f"{summary['gpus']:,}"
    head, *rows = _cells(page, "Who pays what")
    assert head == ["task", "tokens", "gpu_s", "share", "gpu_s_per_1k_tokens"]
    for row, cost in zip(rows, task_cost_rows(runs[0]), strict=True):
        cells = dict(zip(head, row, strict=True))
        assert cells["tokens"] == f"{cost['tokens']:,}" and "," in cells["tokens"]  # thousands of tokens
        assert cells["gpu_s"] == f"{cost['gpu_s']:,.3f}"
        assert cells["gpu_s_per_1k_tokens"] == f"{cost['gpu_s_per_1k_tokens']:,.3f}"
        assert cells["share"] == cost["share"]
    head, row = _cells(page, "lorafleet's deployment")
    assert dict(zip(head, row, strict=True)) == {
        "replica": "0",
        "config": "&lt;1,1&gt;",
        "gpus": "0",
        "max_tokens": "12,345",
        "expected_s": "1.235",
    }


def test_summary_json_keeps_the_raw_numbers(report):
    runs, source, _, out = report
    summary = json.loads((out / "summary.json").read_text())
    assert [m["saved_by_lorafleet"] for m in summary["methods"]] == [
        r["saved_by_lorafleet"] for r in summary_rows(runs)
    ]
    assert summary["cluster"] == {"gpu": "A100-80GB", "gpus": 8} and summary["cost_model"] == source


@pytest.mark.parametrize(
    "column,value,text",
    [
        ("saved_by_lorafleet", 0.53412, "53.4 %"),
        ("utilisation", 1.0, "100.0 %"),
        ("mean_step_s", 1234.56789, "1,234.568"),
        ("tokens", 1234567, "1,234,567"),
        ("gpu_s_per_1k_tokens", float("nan"), "n/a"),
        ("share", "12.3 %", "12.3 %"),
        ("failures", 0, "0"),
    ],
)
def test_format_value(column, value, text):
    assert format_value(column, value) == text


def test_simulate_cli_report_names_the_cluster_and_cost_model(tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["simulate", str(EXAMPLES / "lobra-7b.yaml"), "--gpu", "A100-80GB", "--steps", "1", "--report", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    page = (out / "index.html").read_text()
    assert "16 x A100-80GB" in page and "cost model analytic:A100-80GB" in page
    assert re.search(r"<td>\d+\.\d %</td>", page)


def test_a_cost_plans_report_plots_its_frontier(report, tmp_path, capsys):
    """#43: the report of a plan made by ``--objective cost`` shows its cost frontier (a table of the plan's
    ``cost_frontier``, the chosen plan marked, and frontier.png); a plan of the makespan objective has none."""
    import yaml

    from lorafleet.plans import DeploymentPlan
    from tests.helpers.pools import POOLS_WORKLOAD

    assert "Cost frontier" not in report[2] and not (report[3] / "frontier.png").exists()
    workload = tmp_path / "pools.yaml"
    workload.write_text(yaml.safe_dump(POOLS_WORKLOAD))
    plan, out = tmp_path / "plan.json", tmp_path / "report"
    assert main(["plan", str(workload), "--objective", "cost", "--samples", "0", "--json", str(plan)]) == 0
    assert main(["simulate", str(workload), "--plan", str(plan), "--steps", "2", "--report", str(out)]) == 0
    capsys.readouterr()
    page = (out / "index.html").read_text()
    head, *rows = _cells(page, "Cost frontier")
    frontier = DeploymentPlan.load(plan).cost_frontier
    assert head == ["step_s", "cost_per_step", "gpus", "deployment", "chosen"] and len(rows) == len(frontier) >= 3
    assert [row[4] for row in rows].count("yes") == 1
    assert (out / "frontier.png").stat().st_size > 0 and '<img src="frontier.png">' in page
