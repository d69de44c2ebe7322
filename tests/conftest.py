"""Test setup: 8 simulated CPU devices (set before JAX is imported) and strict ranks."""

import os
import sys

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  (must follow the XLA_FLAGS line)

jax.config.update('jax_numpy_rank_promotion', 'raise')
