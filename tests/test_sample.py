"""sample.generate, the continuation train.py prints at the end: at top_k=1 it is greedy
decoding, so it must equal HF transformers' greedy `generate` on the same weights; and
it never picks an id of the padded vocabulary rows."""

import torch
from transformers import Olmo3ForCausalLM

from evaluation import sample
from formats import hf_ckpt
from test_model import make_hf


def test_top1_equals_hf_greedy_generation_with_a_padded_vocab(tmp_path):
  path = make_hf(tmp_path, 'gqa')  # 250 ids
  params, cfg = hf_ckpt.load_hf(path, pad_vocab_to=128)  # 256 head rows, 6 of them padding
  cfg.dtype = 'float32'
  assert params['lm_head']['w'].shape[1] == 256
  # Padding rows the argmax would pick if the sampler did not cut them off.
  params['lm_head']['w'][:, 250:] = 50.0
  prompt = [5, 17, 200, 3, 99]
  ours = sample.generate(cfg, params, prompt, 12, vocab_size=250, max_len=64, top_k=1)
  hf = Olmo3ForCausalLM.from_pretrained(path, attn_implementation='eager')
  with torch.no_grad():
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                       pad_token_id=1, eos_token_id=None)[0].tolist()
  assert ours == want
  assert len(sample.generate(cfg, params, prompt, 100, vocab_size=250, max_len=9,
                             top_k=1)) == 9  # cut at max_len


def test_sampling_is_seeded_and_stays_in_the_vocabulary(tmp_path):
  params, cfg = hf_ckpt.load_hf(make_hf(tmp_path, 'mha'), pad_vocab_to=128)
  cfg.dtype = 'float32'
  params['lm_head']['w'][:, 250:] = 50.0
  prompt = [7, 8, 9]

  def draw(seed):
    return sample.generate(cfg, params, prompt, 40, vocab_size=250, max_len=64,
                           temperature=5.0, top_k=40, seed=seed)
  first = draw(0)
  assert first == draw(0) and first != draw(1)
  assert first[:3] == prompt and len(first) == 43
  assert max(first) < 250 and len(set(first[3:])) > 10  # spread, none of the padding rows
