"""bench/profile_breakdown.py on a hand-written TPU trace and HLO, labelled by hand."""

import os
import subprocess
import sys

from jax.profiler import ProfileData
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'bench'))
import profile_breakdown  # pylint: disable=g-import-not-at-top,wrong-import-position

# What a compiled train step's HLO looks like where it matters: op_name metadata on the
# instructions or inside the computations fusions call.
HLO = '''HloModule jit_train_step

%fused_matmul (p0: bf16[8,8], p1: bf16[8,8]) -> bf16[8,8] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  %p1 = bf16[8,8]{1,0} parameter(1)
  ROOT %convolution.1 = bf16[8,8]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf, metadata={op_name="jit(train_step)/jvp()/dot_general"}
}

%fused_norm (p0: bf16[8,8]) -> bf16[8,8] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  ROOT %multiply.1 = bf16[8,8]{1,0} multiply(%p0, %p0), metadata={op_name="jit(train_step)/transpose(jvp())/checkpoint/rematted_computation/mul"}
}

%body (p: bf16[8,8]) -> bf16[8,8] {
  %p = bf16[8,8]{1,0} parameter(0)
  ROOT %fusion.loss = bf16[8,8]{1,0} fusion(%p), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(train_step)/transpose(jvp(loss))/while/body/mul"}
}

ENTRY %main (a: bf16[8,8], b: bf16[8,8]) -> bf16[8,8] {
  %a = bf16[8,8]{1,0} parameter(0)
  %b = bf16[8,8]{1,0} parameter(1)
  %fusion.mm = bf16[8,8]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_matmul
  %custom-call.fa = bf16[8,8]{1,0} custom-call(%a), custom_call_target="tpu_custom_call", metadata={op_name="jit(train_step)/transpose(jvp())/checkpoint/rematted_computation/flash_attention_fwd"}
  %fusion.remat = bf16[8,8]{1,0} fusion(%a), kind=kLoop, calls=%fused_norm
  %while.1 = bf16[8,8]{1,0} while(%a), condition=%cond, body=%body
  ROOT %add.upd = bf16[8,8]{1,0} add(%a, %b), metadata={op_name="jit(train_step)/add"}
}
'''

# (instruction, microseconds) per step, in order; %while.1 spans the loss op inside it.
OPS = [('%fusion.mm', 40), ('%custom-call.fa', 20), ('%fusion.remat', 10), ('%while.1', 15),
       ('%fusion.loss', 15), ('%add.upd', 5), ('%fusion.other_module', 3)]
STEP_US = 100


def _xspace(steps: int) -> bytes:
  names = {name: i for i, (name, _) in enumerate(OPS, 1)}
  ops, modules, t = [], [], 0
  for _ in range(steps):
    modules.append(f'events {{ metadata_id: 100 offset_ps: {t * 10**6} '
                   f'duration_ps: {STEP_US * 10**6} }}')
    for name, us in OPS:
      ops.append(f'events {{ metadata_id: {names[name]} offset_ps: {t * 10**6} '
                 f'duration_ps: {us * 10**6} }}')
      if name != '%while.1':
        t += us
    t = (t // STEP_US + 1) * STEP_US
  metadata = [f'event_metadata {{ key: {i} value {{ id: {i} name: "{name} = bf16[8,8] op()" }} }}'
              for name, i in names.items()]
  text = ('planes { id: 1 name: "/device:TPU:0" '
          f'lines {{ id: 1 name: "XLA Modules" {" ".join(modules)} }} '
          f'lines {{ id: 2 name: "XLA Ops" {" ".join(ops)} }} '
          + ' '.join(metadata) +
          ' event_metadata { key: 100 value { id: 100 name: "jit_train_step(1)" } } }')
  return ProfileData.text_proto_to_serialized_xspace(text)


@pytest.fixture(name='trace')
def _trace(tmp_path):
  (tmp_path / 'host.xplane.pb').write_bytes(_xspace(steps=2))
  (tmp_path / 'step.hlo.txt').write_text(HLO)
  return tmp_path


def test_each_op_lands_in_its_phase_and_kind(trace):
  result = profile_breakdown.breakdown(str(trace), HLO)
  ms = lambda us: pytest.approx(us / 1e3)
  assert result['steps'] == 2 and result['step (ms)'] == ms(STEP_US)
  assert result['ops (ms)'] == {
      'forward / matmuls': ms(40),  # the op_name of the convolution it fuses
      'remat recompute / attention kernels': ms(20),
      'remat recompute / other': ms(10),
      'backward / loss': ms(15),  # inside the loop, which itself is not counted
      'update and metrics / other': ms(5),
  }
  assert result['not in the HLO (ms)'] == ms(3)
  assert result['idle (ms)'] == ms(STEP_US - 90)


def test_cli_prints_the_table_and_refuses_what_it_cannot_read(trace):
  script = os.path.join(REPO, 'bench', 'profile_breakdown.py')
  run = lambda *a: subprocess.run([sys.executable, script, *a], capture_output=True, text=True,
                                  timeout=120)
  out = run(f'--trace={trace}', f'--hlo={trace / "step.hlo.txt"}')
  assert out.returncode == 0, out.stderr
  assert '2 steps, 0.1 ms per step' in out.stdout and 'forward / matmuls' in out.stdout
  missing = run(f'--trace={trace}', '--hlo=/nonexistent.txt')
  assert missing.returncode == 2 and '--hlo=/nonexistent.txt does not exist' in missing.stderr
  empty = trace / 'empty'
  empty.mkdir()
  nothing = run(f'--trace={empty}', f'--hlo={trace / "step.hlo.txt"}')
  assert nothing.returncode == 1 and 'no *.xplane.pb trace' in nothing.stderr
  assert 'Traceback' not in missing.stderr + nothing.stderr
