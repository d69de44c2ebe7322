"""Olmo 3 32B: the 7B recipe's code path at 32B scale (HF `allenai/Olmo-3-1125-32B`,
OLMo-core `src/scripts/official/OLMo-3-1025-32B.py`)."""

import ml_collections

from configs import olmo3_7b


def get_config() -> ml_collections.ConfigDict:
  c = olmo3_7b.get_config()
  m = c.model
  m.num_layers = 64  # HF num_hidden_layers
  m.d_model = 5120  # HF hidden_size
  m.num_heads = 40  # HF num_attention_heads
  m.num_kv_heads = 8  # HF num_key_value_heads (GQA 5:1)
  m.head_dim = 128  # d_model / num_heads
  m.mlp_hidden = 27648  # HF intermediate_size
  c.data.global_batch_size = 1024  # OLMo-core OLMo-3-1025-32B.py: GLOBAL_BATCH_SIZE 8M tokens
  c.data.repetition_filter = True  # OLMo-core OLMo-3-1025-32B.py: InstanceFilterConfig(13, 1, 32)
  c.opt.lr = 6e-4  # OLMo-core OLMo-3-1025-32B.py: LR
  c.opt.final_lr = 6e-5  # OLMo-core CosWithWarmup default alpha_f = 0.1
  c.opt.schedule = 'cosine'  # OLMo-core OLMo-3-1025-32B.py: CosWithWarmup(warmup_steps=2000)
  c.train.steps = 706_907  # one epoch of the same mix at 1024 instances per batch
  c.opt.t_max = c.train.steps  # OLMo-core CosWithWarmup default: t_max = max_duration
  return c
