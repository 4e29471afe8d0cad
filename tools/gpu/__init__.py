"""The GPU check (``python -m moefold.tools.gpu.check``, ``scripts/gpu_check.sh``): bounded steps on a
lent GPU machine (the torch API, CUDA against the CPU, host syncs, proxy training runs, the MoE-layer benchmark,
tests/gpu, --compile; then installs from carried wheels and FP8), one Markdown report.

Holds: check (the steps, their budget and the report), steps (running one bounded step, its status from its
output), parity (whole tiny models on the device against the CPU), train_rows (``moefold train`` runs at a proxy
size beside ``moefold plan``), bench (the measurements), peers and peers_step (moefold's MoE layer and training step
next to HF transformers and TorchTitan on the same card), install (carried wheels and what they make importable),
torch_uses (the torch names moefold uses), torch_api (those checked against a release).
May import: everything in moefold but the planner (train_rows runs ``moefold train`` and ``moefold plan`` through
``training.cli.main``, which routes ``plan`` by module name); nothing imports it.
"""
