"""The MoE decoder model, recipes, multi-token prediction and HF checkpoint interop."""
