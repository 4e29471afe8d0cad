"""Dispatcher benchmark: a thin script over ``moefold bench-dispatch`` (tools/bench_dispatch.py).

    python examples/bench_dispatch.py --dispatcher alltoall --ep 4 --num-tokens 4096 --hidden 512 \
        --num-experts 16 --topk 2
    torchrun --nproc-per-node 8 examples/bench_dispatch.py --ep 8 --dtype bf16   # GPUs, NCCL
"""

import argparse
import sys

from moefold.tools import bench_dispatch

if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False, description=bench_dispatch.__doc__.splitlines()[0])
    bench_dispatch.add_arguments(parser)
    sys.exit(bench_dispatch.main(parser.parse_args()))
