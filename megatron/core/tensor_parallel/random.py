"""Named RNG streams for tensor parallelism, and activation recomputation that replays them.

``model_parallel_cuda_manual_seed(seed)`` sets up three streams:

* the default generator, seeded with ``seed`` (the same on every TP rank: dropout outside
  TP regions draws the same mask on every rank holding the same activations);
* ``"model-parallel-rng"``, seeded with ``seed + 2718 + tp_rank`` (different per TP rank:
  dropout on TP-sharded activations draws independent masks per shard);
* ``"data-parallel-rng"`` (``seed``) and ``"expert-parallel-rng"``
  (``seed + 1024 + 100 ep_rank + etp_rank``).

``get_cuda_rng_tracker().fork(name)`` runs a block with a stream's state and puts it back
afterwards, advanced. The streams live on the device of the default process group's backend:
the current CUDA device with nccl, the CPU generator with gloo or without torch.distributed
(so CPU runs fork the CPU generator).

``checkpoint(function, distribute_saved_activations, *args)`` runs ``function`` without
keeping activations and recomputes it in the backward with the RNG states (default and
tracked) it had in the forward, so dropout masks are identical in the recomputation.

``CheckpointWithoutOutput`` goes one step further (megatron-core's semantics): its
``checkpoint(function, *args)`` keeps only the inputs, and after the caller has used the
output (e.g. a norm's output consumed by the next linear layer, which saves it for its own
backward), ``discard_output_and_register_recompute(hook_tensor)`` frees the output's storage
and recomputes it, in place, when the gradient of ``hook_tensor`` is computed -- before any
backward that reads the saved output runs.
"""

import contextlib
from typing import Any, Dict, Optional, Union

import torch

from megatron.core.device import comm_device
from megatron.core.process_groups_config import get_pg_rank, resolve_group

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: Optional[int] = None,
    ep_rank: Optional[int] = None,
    etp_rank: Optional[int] = None,
    force_reset_rng: bool = False,
) -> None:
    """Seed the default generator and the tracked streams (module docstring).

    ``tp_rank=None``: the rank in the MPU fallback's TP group (``resolve_group("tp")``:
    ``parallel_state``'s when initialized), else 0; ``ep_rank``/``etp_rank`` likewise in the
    expert groups (0 without expert parallelism).
    """
    if not isinstance(seed, int):
        raise TypeError(f"model_parallel_cuda_manual_seed: seed must be an int, got {seed!r}")
    if tp_rank is None:
        tp_rank = get_pg_rank(resolve_group("tp"))
    if ep_rank is None:
        ep_rank = get_pg_rank(resolve_group("ep"))
    if etp_rank is None:
        etp_rank = get_pg_rank(resolve_group("expt_tp"))
    initialize_rng_tracker(
        te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng
    )
    tracker = _CUDA_RNG_STATE_TRACKER
    tracker.reset()
    device = _rng_device()
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> "CudaRNGStatesTracker":
    """The process-wide tracker (created on first use)."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return _CUDA_RNG_STATE_TRACKER


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Create the process-wide tracker (again with ``force_reset``). Transformer Engine,
    CUDA-graph-safe and inference trackers are not supported (a clear error)."""
    global _CUDA_RNG_STATE_TRACKER
    for name, value in (
        ("use_te_rng_tracker", use_te_rng_tracker),
        ("inference_rng_tracker", inference_rng_tracker),
        ("use_cudagraphable_rng", use_cudagraphable_rng),
    ):
        if value:
            raise NotImplementedError(
                f"RNG tracker: {name}=True is not supported (no Transformer Engine / CUDA "
                "graphs); expected False"
            )
    if _CUDA_RNG_STATE_TRACKER is None or force_reset:
        _CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_expert_parallel_rng_tracker_name() -> str:
    """Name of the expert-parallel stream."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    """Name of the data-parallel stream."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


class CudaRNGStatesTracker:
    """Named generator states; ``fork(name)`` runs a block with one of them.

    The states are those of the CUDA generator with nccl and of the CPU generator with gloo
    or without torch.distributed (decided when a state is added).
    """

    def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
        if use_cudagraphable_rng:
            raise NotImplementedError(
                "CudaRNGStatesTracker: use_cudagraphable_rng=True is not supported; expected False"
            )
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self) -> bool:
        """Whether a state was added or set."""
        return self._is_initialized

    def reset(self) -> None:
        """Forget every state."""
        self._is_initialized = False
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()
        self._device = None
        self._current: Optional[str] = None  # the stream a fork is running, if any

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A new dict of the current states (the state tensors themselves are not changed
        later: a fork stores a new tensor)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the states (e.g. with ones from ``get_states``)."""
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Track a new state, the generator seeded with ``seed`` (the current generator
        state is left as it was). Names and seeds must be new."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: rng state {name!r} already exists")
        if self._device is None:
            self._device = _rng_device()
        self.seeds_.add(seed)
        original = _get_rng_state(self._device)
        _manual_seed(self._device, seed)
        self.states_[name] = _get_rng_state(self._device)
        _set_rng_state(original, self._device)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block with state ``name``; afterwards store its advanced state and put the
        previous generator state back."""
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker.fork: rng state {name!r} is not added")
        device = self._device or _rng_device()
        original = _get_rng_state(device)
        outer = self._current
        if outer is not None:  # nested fork: the outer stream's advanced state is current
            self.states_[outer] = original
        _set_rng_state(self.states_[name], device)
        self._current = name
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state(device)
            self._current = outer
            _set_rng_state(self.states_[outer] if outer is not None else original, device)


def convert_cuda_rng_state(
    state: Union[torch.Tensor, torch.Generator], to_graphable: bool = False
) -> Union[torch.Tensor, torch.Generator]:
    """The state unchanged (graph-safe states are not supported: ``to_graphable=True`` is an
    error)."""
    if to_graphable:
        raise NotImplementedError(
            "convert_cuda_rng_state: to_graphable=True (CUDA graphs) is not supported"
        )
    if isinstance(state, torch.Generator):
        return state.get_state()
    return state


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker) -> bool:
    """Whether the tracker keeps CUDA-graph-safe states (never, here)."""
    return bool(getattr(cuda_rng_tracker, "use_cudagraphable_rng", False))


def checkpoint(function, distribute_saved_activations, *args):
    """``function(*args)`` without keeping its activations; recomputed in the backward with
    the forward's RNG states (default generators and the tracker's streams).

    ``distribute_saved_activations=True`` (splitting saved inputs over TP) is not supported.
    """
    if distribute_saved_activations:
        raise NotImplementedError(
            "checkpoint: distribute_saved_activations=True is not supported; expected False"
        )
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)


def is_checkpointing() -> bool:
    """Whether a ``checkpoint`` recomputation is running."""
    return _IS_CHECKPOINTING


class CheckpointFunction(torch.autograd.Function):
    """Forward without autograd; backward = restore RNG states, recompute with autograd,
    back-propagate, put the RNG states back."""

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        """Run ``run_function(*args)`` under no_grad, remembering the RNG states."""
        ctx.run_function = run_function
        ctx.rng_states = _get_all_rng_states()
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.tensor_indices = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.other_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_indices))
        return _detach_passed_through(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        """Recompute with the saved RNG states and back-propagate into the inputs."""
        global _IS_CHECKPOINTING
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "checkpoint: recomputation is not compatible with torch.autograd.grad(); use "
                ".backward()"
            )
        inputs = list(ctx.other_args)
        for index, tensor in zip(ctx.tensor_indices, ctx.saved_tensors):
            detached = tensor.detach()
            detached.requires_grad_(tensor.requires_grad)
            inputs[index] = detached
        current = _get_all_rng_states()
        _set_all_rng_states(ctx.rng_states)
        _IS_CHECKPOINTING = True
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            _IS_CHECKPOINTING = False
            _set_all_rng_states(current)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if torch.is_tensor(out) and out.requires_grad
        ]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        grads = tuple(
            inp.grad if torch.is_tensor(inp) and inp.requires_grad else None for inp in inputs
        )
        return (None, None) + grads


class CheckpointWithoutOutput:
    """Checkpoint a function and release its output until the backward needs it.

    ``out = ckpt.checkpoint(function, *args)`` runs ``function`` without autograd (inputs
    saved, RNG states remembered); ``ckpt.discard_output_and_register_recompute(t)`` frees the
    storage of ``out`` (its metadata stays) and registers a gradient hook on ``t`` that reruns
    ``function`` with the forward's RNG states and refills ``out``'s storage in place; the
    backward into ``args`` then runs through the recomputed graph. The caller guarantees that
    nothing reads ``out`` between the discard and the moment ``t``'s gradient is computed.
    ``fp8`` is megatron-core's parameter (FP8 recipes are not supported: None or False).
    """

    def __init__(self, fp8: Any = False) -> None:
        if fp8:
            raise NotImplementedError(
                f"CheckpointWithoutOutput: fp8={fp8!r} is not supported; expected False"
            )
        self.fp8 = False
        self.run_function = None
        self.rng_states: Optional[Dict[str, Any]] = None
        self.ctx = None
        self.outputs = None

    def checkpoint(self, run_function, *args):
        """``run_function(*args)`` without keeping its activations (see the class)."""
        self.run_function = run_function
        self.rng_states = _get_all_rng_states()
        outputs = _CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage; recompute them when ``hook_tensor``'s gradient is
        computed (nothing is registered if ``hook_tensor`` needs no gradient)."""
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad) -> None:
        """Gradient hook: rerun the function with the forward's RNG states, put the values
        back into the discarded outputs' storage, keep the graph for the backward."""
        if self.ctx is None:  # already recomputed
            return
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "CheckpointWithoutOutput: recomputation is not compatible with "
                "torch.autograd.grad(); use .backward()"
            )
        inputs = []
        for tensor in self.ctx.saved_tensors:
            detached = tensor.detach()
            detached.requires_grad_(tensor.requires_grad)
            inputs.append(detached)
        args = list(self.ctx.other_args)
        for index, tensor in zip(self.ctx.tensor_indices, inputs):
            args[index] = tensor
        current = _get_all_rng_states()
        _set_all_rng_states(self.rng_states)
        try:
            with torch.enable_grad():
                outputs = self.run_function(*args)
        finally:
            _set_all_rng_states(current)
        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        with torch.no_grad():
            for kept, fresh in zip(self.outputs, outputs):
                kept.untyped_storage().resize_(fresh.untyped_storage().size())
                kept.untyped_storage().copy_(fresh.untyped_storage())
        self.ctx.recomputed_outputs = outputs
        self.ctx.recomputed_inputs = args
        self.run_function, self.rng_states, self.outputs, self.ctx = None, None, None, None


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    """Forward without autograd (inputs saved); backward through the graph the owner's
    recompute hook built."""

    @staticmethod
    def forward(ctx, run_function, owner: CheckpointWithoutOutput, *args):
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.tensor_indices = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.other_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_indices))
        owner.ctx = ctx
        return _detach_passed_through(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        outputs = getattr(ctx, "recomputed_outputs", None)
        if outputs is None:
            raise RuntimeError(
                "CheckpointWithoutOutput: the backward reached the checkpointed function "
                "before its output was recomputed; call discard_output_and_register_recompute "
                "with a tensor whose gradient is computed earlier"
            )
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if torch.is_tensor(out) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        inputs = ctx.recomputed_inputs
        ctx.recomputed_outputs = ctx.recomputed_inputs = None
        grads = tuple(
            inp.grad if torch.is_tensor(inp) and inp.requires_grad else None for inp in inputs
        )
        return (None, None) + grads


def _detach_passed_through(outputs):
    """Outputs that still require grad after a no-grad run are tensors the function passed
    through (a parameter such as an MLP's skipped bias): returned detached, so autograd
    gives them this function's node instead of attaching it to the parameter itself; the
    recomputation returns the parameter again and back-propagates into it."""
    if torch.is_tensor(outputs):
        return outputs.detach() if outputs.requires_grad else outputs
    if isinstance(outputs, tuple):
        return tuple(_detach_passed_through(o) if torch.is_tensor(o) else o for o in outputs)
    return outputs


# ---------------------------------------------------------------------------------------------

_CUDA_RNG_STATE_TRACKER: Optional[CudaRNGStatesTracker] = None
_IS_CHECKPOINTING = False


def _rng_device() -> torch.device:
    """CUDA with an nccl default group, else CPU."""
    return comm_device()


def _get_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _manual_seed(device: torch.device, seed: int) -> None:
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def _get_all_rng_states() -> Dict[str, Any]:
    """CPU state, CUDA state (when CUDA is initialized) and the tracker's states."""
    cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    tracker = _CUDA_RNG_STATE_TRACKER
    return {
        "cpu": torch.get_rng_state(),
        "cuda": cuda_state,
        "tracker": tracker.get_states() if tracker is not None else None,
    }


def _set_all_rng_states(states: Dict[str, Any]) -> None:
    torch.set_rng_state(states["cpu"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state(states["cuda"])
    if states["tracker"] is not None and _CUDA_RNG_STATE_TRACKER is not None:
        _CUDA_RNG_STATE_TRACKER.set_states(states["tracker"])
