"""The end of a run: a run that started torch.distributed leaves no process group behind.

A gloo group's threads stop only when its last reference goes. Left alive until interpreter
exit, they can abort a worker after a successful run ("terminate called without an active
exception"), and torchrun then stops its peers: a healthy launch ends with exit 1 (seen
once in CI, in the SIGTERM test of ``test_exits.py``). ``pretrain`` destroys the group it
created, the cached subgroups go with it, and the model (whose DDP gradient hooks held it,
``test_ddp.py::test_an_unreachable_ddp_wrapper_is_freed_with_its_module``) is freed.
"""

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.training import TrainingConfig
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import fresh_layout
from tests.unit_tests.launch import LAUNCHER_VARS, free_port

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, disable_bias_linear=True)


def _gloo_threads() -> int:
    """This process's threads that belong to gloo process groups."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum(name in GLOO_THREADS for name in names)


@pytest.mark.world(1)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.parametrize("teardown", ["dense", "moe", "groups-kept-control"])
def test_a_run_that_started_torch_distributed_leaves_no_gloo_thread(monkeypatch, teardown):
    """One process launched as torchrun would (WORLD_SIZE=1): ``pretrain`` starts a gloo
    group and its layout's subgroups, trains a dense or MoE GPT with DDP, and returns with
    every gloo thread gone. Control: when the cached subgroups outlive the default group,
    it fails."""
    if dist.is_initialized():
        pytest.skip("this process already has a default group (pretrain would reuse it)")
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    launch = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    launch.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    if teardown == "groups-kept-control":  # the old destroy_model_parallel: groups cached
        monkeypatch.setattr(parallel_state, "destroy_model_parallel", lambda: None)
    threads = torch.get_num_threads()  # pretrain sets the intra-op threads per process
    before = _gloo_threads()
    try:
        with fresh_layout():
            result = pretrain(
                TrainingConfig(
                    num_layers=2, hidden_size=16, seq_length=16, global_batch_size=2,
                    train_iters=2, progress=False, distributed_backend="gloo",
                    **(MOE if teardown == "moe" else {}),
                )
            )  # fmt: skip
        after = _gloo_threads()
    finally:
        torch.set_num_threads(threads)
        monkeypatch.undo()
        parallel_state.destroy_model_parallel()  # the control's groups go here
        gc.collect()
    assert len(result.records) == 2 and not dist.is_initialized()
    if teardown != "groups-kept-control":
        assert after == before, f"{after - before} gloo threads outlive the run"
    else:
        assert after > before, "the control left no group: the check cannot fail"
    assert _gloo_threads() == before
