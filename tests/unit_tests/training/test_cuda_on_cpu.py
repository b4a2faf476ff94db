"""The CPU launcher ``megatron.training.cuda_on_cpu``: its documented mapping of CUDA calls,
and a megatron-core-style CUDA script (``scripts/mcore_style_train_loop.py``: TP = 2 GPT,
DDP, mock data, ``dist_checkpointing`` save and load) run unchanged on 2 CPU ranks."""

import pytest
import torch
import torch.distributed as dist

from megatron.training import cuda_on_cpu
from tests.unit_tests.launch import ROOT, run_torchrun

SCRIPT = ROOT / "tests" / "unit_tests" / "training" / "scripts" / "mcore_style_train_loop.py"


@pytest.mark.world(1)
def test_the_mapping_sends_cuda_calls_to_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, *a, **k: calls.append(backend))
    cuda_on_cpu.install()
    try:
        assert torch.device("cuda") == torch.device("cpu") == torch.device("cuda:1")
        assert torch.device("cuda", 1).type == "cpu" and torch.device("meta").type == "meta"
        assert isinstance(torch.zeros(1).device, torch.device)
        torch.cuda.set_device(3)
        torch.cuda.synchronize()
        assert torch.zeros(2).to("cuda").device.type == "cpu"
        assert torch.zeros(2).to(device="cuda:0", dtype=torch.float64).dtype == torch.float64
        assert torch.zeros(2).cuda().device.type == "cpu"
        layer = torch.nn.Linear(2, 2).to(torch.device("cuda")).cuda()
        assert layer.weight.device.type == "cpu"
        dist.init_process_group(backend="nccl")
        dist.init_process_group()
        dist.init_process_group("gloo")
        assert calls == ["gloo", "gloo", "gloo"]
        assert torch.cuda.is_available() is False or torch.cuda.device_count() > 0
    finally:
        cuda_on_cpu.uninstall()
    assert torch.device("cuda").type == "cuda"


@pytest.mark.world(1)
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tokenizer", ["megatron-tokenizer", "legacy-tokenizer"])
def test_a_cuda_script_runs_unchanged_on_two_cpu_ranks(tmp_path, tokenizer):
    target = ["-m", "megatron.training.cuda_on_cpu", str(SCRIPT), tokenizer]
    code, output, _ = run_torchrun(
        2, target, limit_s=240, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)}
    )
    assert code == 0, output[-3000:]
    assert output.count("Successfully loaded the model") == 2, output[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: reloaded weights equal the saved ones: True" in output
    assert (tmp_path / "ckpt" / "metadata.json").exists()
