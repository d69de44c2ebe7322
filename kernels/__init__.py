"""Pallas TPU kernels. See kernels/flash_attention.py."""

from kernels.flash_attention import BlockSizes
from kernels.flash_attention import block_schedule
from kernels.flash_attention import default_block_sizes
from kernels.flash_attention import flash_attention
from kernels.flash_attention import kv_block_visits
from kernels.flash_attention import reference_attention
from kernels.flash_attention import TPU_DEVICE_KINDS

__all__ = [
    'BlockSizes', 'block_schedule', 'default_block_sizes', 'flash_attention',
    'kv_block_visits', 'reference_attention', 'TPU_DEVICE_KINDS',
]
