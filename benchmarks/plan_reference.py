"""Dump ``moefold plan``'s ranked layouts and their numbers (memory by component, step time by term) as JSON, so that
a faster search can be held to the output of the code it replaces (``tests/planner/test_search_fast.py``).

    python benchmarks/plan_reference.py OUT.json --recipe qwen3_moe_30b_a3b --gpus 8 [moefold plan flags]
"""

from __future__ import annotations

import argparse
import json
import sys


def plan_record(plan) -> dict:
    """What a ranked plan is: its layout and options (the fields ``moefold train`` takes) and its numbers."""
    t, o, s = plan.config.train, plan.config.options, plan.sizes
    return {"sizes": [s.tp, s.cp, s.pp, s.ep, s.etp],
            "pipeline": {k: v for k, v in vars(t.execution).items() if isinstance(v, (int, float, str, bool))
                         or v is None},
            "micro_batch_size": t.micro_batch_size, "num_micro": plan.num_micro,
            "recompute": plan.recompute, "sharding": plan.sharding, "schedule": plan.schedule,
            "recompute_modules": list(o.recompute_modules), "offload_modules": list(o.offload_modules),
            "memory": {**plan.memory.components, "host": plan.memory.host, "pp_rank": plan.memory.pp_rank},
            "time": {**plan.time.terms, "flops_per_gpu": plan.time.flops_per_gpu, "total": plan.time.total},
            "tokens_per_s_per_gpu": plan.time.tokens_per_s_per_gpu}


def search_result(argv: list[str]):
    """``moefold plan argv``'s search result (``planner.search.search``), without printing."""
    from moefold.planner.cli import add_arguments, config_from_args
    from moefold.planner.cluster import load_cluster, parse_bytes
    from moefold.planner.search import search

    p = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(p)
    args = p.parse_args(argv)
    cluster = load_cluster(args.cluster)
    memory = parse_bytes(args.gpu_memory) if args.gpu_memory else cluster.memory_bytes
    config, fixed = config_from_args(args)
    return search(config, args.gpus, cluster, args.gpus_per_node, memory, fixed=fixed, top=args.top,
                  headroom=args.memory_headroom, efficiency=args.efficiency, exact=args.exact)


def main(argv: list[str]) -> int:
    out, argv = argv[0], argv[1:]
    result = search_result(argv)
    record = {"argv": argv, "valid": result.valid, "considered": result.considered,
              "plans": [plan_record(p) for p in result.plans]}
    with open(out, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
