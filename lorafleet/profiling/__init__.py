"""Measuring a model's cost-model records on this machine (``lorafleet profile``).

:mod:`.run` spawns one process per device and runs the sweep, :mod:`.device` sets each one up
(gloo on CPU, NCCL on CUDA), :mod:`.replica` builds a replica of a parallel config,
:mod:`.stages` and :mod:`.measure` time its steps and record its peak memory.
"""
