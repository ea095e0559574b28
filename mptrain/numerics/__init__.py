"""The numerics of a run, one module each, so that "where does MXFP4 round" is answered by names:

- ``formats``: element formats (E4M3, E5M2, FP6, FP4, FP16, BF16), their grids and rounding (RNE,
  saturation, stochastic rounding from a generator of its own);
- ``mx``: OCP MX and NVFP4 block formats (shared scales, 1D and 2D blocks, random Hadamard);
- ``qgemm``: quantize-dequantize around every GEMM's operands, forward and backward (``im2col``:
  a convolution's wgrad columns);
- ``fused``: the quantizers as they run, compiled and bit-identical to the eager reference
  (``fused_kernels``: the kernel bodies; ``compiled_calls``: calling compiled code in microseconds);
  ``rounding_rng``: stochastic rounding's counter-based random stream;
- ``convert``: ``precision=mx`` (which layers, in which format, and why); ``fp8``: ``precision=fp8``
  (Mellempudi et al.'s E5M2 recipe, hybrid E4M3/E5M2 with tensor or row-wise scales, torchao);
- ``precision``: the one precision object every mode goes through; ``plan``: the per-layer
  precision plan and its FLOPs;
- ``loss_scaling`` (the interface and the static/dynamic/enhanced policies), ``adaptive_scaling``
  and ``adaptive_rule`` (Zhao et al.'s per-layer scales), ``scalers`` (the policy registry);
- ``telemetry`` and ``telemetry_stats`` (gradient underflow and overflow, per layer),
  ``format_stats`` (what block formats do to a run's tensors).

The formats layer (``formats``, ``mx``, ``qgemm``, ``convert``, ``format_stats``) imports nothing of
mptrain but ``mptrain.errors``; the modules above it build on it, never the reverse.
"""
