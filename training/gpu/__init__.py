"""The GPU check (``python -m moefold.training.gpu.check``, ``scripts/gpu_check.sh``): bounded steps on a
lent GPU machine (tests/gpu, host syncs, a proxy training run, the MoE-layer benchmark), one Markdown report.

Holds: check (the steps and the report), steps (running one bounded step), bench (the measurements).
May import: everything below training.cli (it runs the trainer); nothing imports it.
"""
