"""What ``--dpo`` settles before any worker starts (docs/dpo.md): ``--dpo-reference-hf-model``
is a HuggingFace model folder of the policy's architecture, refused by name otherwise; a
resume keeps the seed of the generated pairs it recorded. In-process: the trainer's ``main``
with training replaced by a record (``_run``)."""

import json

import pytest

from megatron.training import cli
from tests.unit_tests.training import test_bad_command_lines as command_lines

pytestmark = pytest.mark.world(1)
_refused = command_lines._refused  # the command-line tests' refusal (exit 2, one line)
POLICY = dict(
    model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=64, rms_norm_eps=1e-5,
)  # fmt: skip
LLAMA = [
    "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "64",
    "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
]  # fmt: skip


def _hf_folder(path, **changes):
    """A folder with only a config.json (all the architecture check reads)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**POLICY, **changes}))
    return str(path)


def test_the_reference_hf_model_is_checked_before_any_worker_starts(tmp_path, capsys, no_training):
    """A missing folder, a file and another architecture are refused by name (exit 2, one
    line, nothing started: a two-process run would otherwise fail in every worker); the
    policy's architecture passes."""
    run = ["--dpo", "--train-iters", "1", "--nproc-per-node", "2", *LLAMA]
    missing = str(tmp_path / "no-model")
    err = _refused(capsys, *run, "--dpo-reference-hf-model", missing)
    assert f"--dpo-reference-hf-model {missing}: " in err and "does not exist" in err
    assert "expected a HuggingFace model folder" in err
    (tmp_path / "file").write_text("")
    err = _refused(capsys, *run, "--dpo-reference-hf-model", str(tmp_path / "file"))
    assert f"--dpo-reference-hf-model {tmp_path / 'file'}: " in err and "is a file" in err
    wider = _hf_folder(tmp_path / "wider", hidden_size=48)
    err = _refused(capsys, *run, "--dpo-reference-hf-model", wider)
    assert f"--dpo-reference-hf-model {wider} is not the policy's architecture" in err
    assert "--hidden-size 32 (its config.json gives 48)" in err
    assert not no_training
    same = _hf_folder(tmp_path / "same")
    assert cli.main([*run[:3], *LLAMA, "--dpo-reference-hf-model", same]) == 0
    assert len(no_training) == 1
