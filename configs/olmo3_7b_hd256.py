"""Co-design ablation: Olmo 3 7B with 16 heads x head_dim 256 (same params and FLOPs).

Ran 12.4% faster on TPU v7 (Ironwood), whose 256x256 MXU a 256-wide head
fills; v5p's MXU is 128 wide, so no gain there. Not the reproduction.
"""

import ml_collections

from configs import olmo3_7b


def get_config() -> ml_collections.ConfigDict:
  c = olmo3_7b.get_config()
  c.model.num_heads = 16  # co-design: 16 x 256 = 4096 = 32 x 128
  c.model.num_kv_heads = 16
  c.model.head_dim = 256
  # attention_impl stays 'auto': on a TPU that is the Pallas kernel, which fills the 256-wide MXU.
  return c
