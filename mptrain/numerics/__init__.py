"""Number formats, emulated faithfully: element formats and rounding (``formats``), OCP MX and NVFP4
block formats (``mx``), quantized GEMM layers (``qgemm``) and ``precision=mx`` (``convert``).

Nothing here imports the rest of mptrain except ``mptrain.errors``: ``mptrain.fp8`` builds on it,
never the reverse.
"""
