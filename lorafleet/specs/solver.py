"""The MILP back ends a user may name (``--solver``, ``DispatchOptions.solver``); ``lorafleet.solvers`` runs them."""

from __future__ import annotations

from enum import StrEnum


class SolverName(StrEnum):
    CBC = "cbc"
    SCIP = "scip"
    HIGHS = "highs"
