"""The XLA flags of the whole test run: this process and every JAX process it starts.

Most of the suite's time on a CPU is XLA compiling small programs, and most of
a compile is LLVM optimizing the generated code. The tests' programs are tiny,
so unoptimized machine code costs them little at run time, while LLVM's level 0
saves a third to a half of the compile time (docs/results/tests.md). XLA's own
HLO passes still run unchanged (same optimized HLO, same buffer assignment and
memory analysis), but the machine code may round differently in the last bit
(fused multiply-adds), so every JAX process of a run must get these flags:
runs compared bit for bit across processes are then compiled alike.
"""

import os

TEST_FLAGS = '--xla_backend_optimization_level=0'


def with_devices(devices: int) -> str:
  """XLA_FLAGS for a subprocess on `devices` simulated CPU devices (the last flag wins)."""
  return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
