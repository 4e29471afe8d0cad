"""The GPU check (``python -m moefold.training.gpu.check``, ``scripts/gpu_check.sh``): bounded steps on a
lent GPU machine (the torch API, host syncs, a proxy training run, the MoE-layer benchmark, tests/gpu,
--compile; then installs from carried wheels), one Markdown report.

Holds: check (the steps and the report), steps (running one bounded step), bench (the measurements), peers and
peers_step (moefold's MoE layer and training step next to HF transformers and TorchTitan on the same card),
install (carried wheels and what they make importable), torch_uses (the torch names moefold uses), torch_api (those
checked against a release).
May import: everything below training.cli (it runs the trainer); nothing imports it.
"""
