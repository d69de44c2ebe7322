"""Olmo 3 7B stage 2 (mid-training anneal): the stage-1 recipe with what changes.

Source: OLMo-core `src/scripts/official/OLMo-3-1025-7B-midtrain.py`; the
numbers are explained in docs/recipe.md. Set `train.init_from` to the final stage-1
checkpoint (ours, or Ai2's converted with `convert.py --from_olmo_core`, which carries
the AdamW moments and count: docs/olmo_core_checkpoints.md) and `data.mix_file` to the midtrain mix (OLMo-core ships
`olmo_core/data/mixes/OLMo-midtraining-mix-0925-ingredient{1,2}-100B.txt`).
"""

import ml_collections

from configs import olmo3_7b


def get_config() -> ml_collections.ConfigDict:
  c = olmo3_7b.get_config()
  c.data.global_batch_size = 256  # OLMo-core midtrain: 256 x 8192 = 2^21 tokens
  c.data.seed = 1337  # OLMo-core midtrain: data seed (epoch 1 order, PCG64(1338))
  c.opt.lr = 2.0712352850360292e-4  # OLMo-core midtrain: LR
  c.opt.schedule = 'linear'  # OLMo-core midtrain: LinearWithWarmup(warmup=0, alpha_f=0)
  c.opt.warmup_steps = 0  # OLMo-core midtrain: no warmup
  c.opt.final_lr = 0.0  # OLMo-core midtrain: alpha_f = 0, decays to zero
  c.opt.t_max = 47_684  # OLMo-core midtrain: 100B tokens / 2^21 per step
  c.train.steps = 47_684  # OLMo-core midtrain: 100B tokens
  # OLMo-core midtrain loads the stage-1 model and optimizer state (moments and
  # Adam count) but starts at trainer step 0: fresh schedule and data order.
  c.train.reset_step_on_init = True  # train.py: apply optim.stage2_reset after loading init_from
  # Stage 1's downstream evals (train.eval_tasks, every 1000 steps) stay on: the official
  # midtrain script attaches none, but they only read the weights; '()' turns them off.
  return c
