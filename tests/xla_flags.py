"""The XLA flags of the whole test run: this process and every JAX process it starts.

Much of the suite's time on a CPU is XLA compiling small programs, and up to
half of a compile is LLVM optimizing the generated code. The tests' programs
are tiny, so plainer machine code costs them little at run time, while LLVM's
level 0 saves a third to a half of the compile time (docs/results/tests.md).
XLA's own HLO passes are unaffected (the same optimized HLO, buffer assignment
and memory analysis), but the machine code can round differently in the last
bit (seen in the small model's gradients), so every JAX process of a run gets
these flags: runs compared bit for bit across processes are compiled alike.
"""

import os

# kernels.xla.CPU_FLAGS too, as train.py sets them (tests run its code in-process too).
TEST_FLAGS = ('--xla_backend_optimization_level=0 '
              '--xla_cpu_enable_concurrency_optimized_scheduler=false')


def with_devices(devices: int) -> str:
  """XLA_FLAGS for a subprocess on `devices` simulated CPU devices (the last flag wins)."""
  return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
