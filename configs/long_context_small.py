"""Stage 3 in miniature on CPU: YaRN, document masking and context parallelism.

The small config (configs/small.py) with stage 3's changes (configs/olmo3_7b_stage3.py):
YaRN on the full-attention layers, attention within documents, a longer
sequence, the linear schedule with warmup, and the sequence split over a
'context' mesh axis of 4 simulated CPU devices. Run it with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (BUILD.md).
"""

import ml_collections

from configs import small


def get_config() -> ml_collections.ConfigDict:
  c = small.get_config()
  m = c.model
  m.yarn.enabled = True  # stage 3: YaRN on full-attention layers
  m.yarn.original_max_position = 256  # small's context before the extension (factor 8 -> 2048)
  m.context_head_stride = 2  # stage 3 gathers kv heads in groups (4 there)

  d = c.data
  d.seq_len = 1024  # 4x small's 256 (stage 3: 8x stage 2's 8192)
  d.global_batch_size = 4  # 4,096 tokens per step
  d.document_masking = True  # stage 3 attends within documents (segment ids from EOS here)
  # Not dataset='packed' here: the corpus is 40 plays, all longer than 1,024 tokens,
  # so packing would keep only each play's first 1,024 tokens (40 instances).

  o = c.opt
  o.schedule = 'linear'  # stage 3: LinearWithWarmup(alpha_f=0)
  o.lr = 3e-3  # small's LR
  o.warmup_steps = 5  # stage 3: 200 of 11,921 steps, scaled
  o.final_lr = 0.0
  o.t_max = 40

  t = c.train
  t.steps = 40
  t.mesh_data, t.mesh_fsdp, t.mesh_context = 1, 1, 4  # the sequence over 4 devices
  t.micro_batch_size = 4
  t.log_every = 5
  t.ckpt_every = 20
  t.eval_every = 20
  t.eval_tasks = ()  # as stage 3: no downstream evals under context parallelism
  return c
