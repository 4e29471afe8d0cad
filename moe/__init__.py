"""Mixture-of-experts: router, load balancing, grouped experts, shared experts, the MoE layer."""
