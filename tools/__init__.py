"""Commands that are not training: the GPU check (``gpu/``: ``python -m moefold.tools.gpu.check``) and the
dispatcher benchmark (``moefold bench-dispatch``: ``bench_dispatch``, its FP8 rows ``bench_dispatch_fp8``).

May import: everything in moefold but the planner; nothing in moefold imports it (the ``moefold`` command routes
``bench-dispatch`` to it by module name).
"""
