"""Number formats, emulated faithfully: element formats and rounding (``formats``), OCP MX and NVFP4
block formats (``mx``), quantized GEMM layers (``qgemm``), ``precision=mx`` (``convert``) and what
block formats do to a run's tensors (``format_stats``, ``telemetry.compare_formats``).

Nothing here imports the rest of mptrain except ``mptrain.errors``: ``mptrain.fp8`` builds on it,
never the reverse.
"""
