"""The ``grouped_mm`` expert backend's CPU-speed machinery, used only by experts built on a CPU (``moe.build``).

``backend.CpuRowsGemm`` (the backend), ``expert_rows`` (the rows' layouts: packed, aligned, uniform),
``rows_gemm`` (the GEMMs on laid-out rows and the layout's choice), ``shortcuts`` (``takes_cpu_shortcut`` and the
``gpu_code_paths()`` switch a host-sync count runs under). The reused CPU buffers are ``dense.workspace``
(below: the main-grad writes of every weight-gradient GEMM use them too).
"""
