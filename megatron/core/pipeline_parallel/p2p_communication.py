"""Point-to-point messages between neighbouring pipeline stages.

Activations travel forward (to the next stage), their gradients backward (to the previous
stage). With PP = 2 the next and the previous stage are the same rank, so both kinds of
message can be in flight between one pair of ranks at once. Two rules keep them apart on
every backend: forward and backward messages carry distinct tags (gloo matches by peer and
tag), and every rank posts its operations in one fixed order -- sends before receives,
and among each, forward messages before backward ones (nccl matches by order). Posting the
sends first also spares gloo's threads work (measured: docs/performance.md, PP=4).
"""

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.communication import p2p_op, run_p2p
from megatron.core.device import comm_device
from megatron.core.model_parallel_config import ModelParallelConfig

Shape = Union[List[int], Tuple[int, ...], torch.Size]

# Message tags: activations, activation gradients, and the shapes sent ahead of each.
_TAG_FORWARD, _TAG_BACKWARD = 1, 2
_TAG_FORWARD_SHAPE, _TAG_BACKWARD_SHAPE = 3, 4


class P2PCommunicator:
    """Sends and receives pipeline messages over ``pp_group`` as ``config`` asks.

    ``config.pipeline_dtype`` is the message dtype, ``batch_p2p_comm`` batches the
    operations of one exchange, ``variable_seq_lengths`` sends shapes ahead of tensors.
    """

    def __init__(self, pp_group: dist.ProcessGroup, config: ModelParallelConfig) -> None:
        self.pp_group = pp_group
        self.config = config
        self.pp_size = pp_group.size()
        self.pp_rank = pp_group.rank()
        self.next_rank = dist.get_global_rank(pp_group, (self.pp_rank + 1) % self.pp_size)
        self.prev_rank = dist.get_global_rank(pp_group, (self.pp_rank - 1) % self.pp_size)
        self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size
        self.device = comm_device(pp_group)  # where messages live (CPU for gloo, GPU for nccl)

    # ------------------------------------------------------------------ 1F1B operations

    def recv_forward(self, tensor_shapes, is_first_stage: bool):
        """Receive this stage's input activations (None on the first stage)."""
        return self._each(
            tensor_shapes, None, lambda shape, _: self._recv_prev(shape, is_first_stage)
        )

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        """Receive the gradient of this stage's output (None on the last stage)."""
        return self._each(
            tensor_shapes, None, lambda shape, _: self._recv_next(shape, is_last_stage)
        )

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        """Send this stage's output activations to the next stage (not on the last)."""
        if not is_last_stage:
            for tensor in _as_list(output_tensors):
                self._communicate(
                    tensor_send_next=tensor,
                    tensor_send_prev=None,
                    recv_prev=False,
                    recv_next=False,
                    tensor_shape=None,
                )

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        """Send the gradient of this stage's input to the previous stage (not on the first)."""
        if not is_first_stage:
            for tensor in _as_list(input_tensor_grads):
                self._communicate(
                    tensor_send_next=None,
                    tensor_send_prev=tensor,
                    recv_prev=False,
                    recv_next=False,
                    tensor_shape=None,
                )

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        """Send activations forward and receive their gradients in one exchange."""
        if is_last_stage:
            return self._each(tensor_shapes, output_tensors, lambda shape, t: None)
        return self._each(
            tensor_shapes,
            output_tensors,
            lambda shape, t: self._communicate(
                tensor_send_next=t,
                tensor_send_prev=None,
                recv_prev=False,
                recv_next=True,
                tensor_shape=shape,
            )[1],
        )

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: bool):
        """Send input gradients backward and receive the next input in one exchange."""
        if is_first_stage:
            return self._each(tensor_shapes, input_tensor_grads, lambda shape, t: None)
        return self._each(
            tensor_shapes,
            input_tensor_grads,
            lambda shape, t: self._communicate(
                tensor_send_next=None,
                tensor_send_prev=t,
                recv_prev=True,
                recv_next=False,
                tensor_shape=shape,
            )[0],
        )

    # ------------------------------------------------------------ interleaved operations
    # The send/recv methods look alike by design: megatron-core's P2PCommunicator API, each a
    # named call of the one ``_communicate`` (which directions, which result).

    def send_forward_recv_forward(
        self,
        output_tensor: Optional[torch.Tensor],
        recv_prev: bool,
        tensor_shape: Shape,
        overlap_p2p_comm: bool = False,
    ) -> Optional[torch.Tensor]:
        """Send activations to the next stage and receive the next input from the previous."""
        _reject_overlap(overlap_p2p_comm)
        return self._communicate(
            tensor_send_next=output_tensor,
            tensor_send_prev=None,
            recv_prev=recv_prev,
            recv_next=False,
            tensor_shape=tensor_shape,
        )[0]

    def send_backward_recv_backward(
        self,
        input_tensor_grad: Optional[torch.Tensor],
        recv_next: bool,
        tensor_shape: Shape,
        overlap_p2p_comm: bool = False,
    ) -> Optional[torch.Tensor]:
        """Send gradients to the previous stage and receive the next output gradient."""
        _reject_overlap(overlap_p2p_comm)
        return self._communicate(
            tensor_send_next=None,
            tensor_send_prev=input_tensor_grad,
            recv_prev=False,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
        )[1]

    def send_forward_backward_recv_forward_backward(
        self,
        output_tensor: Optional[torch.Tensor],
        input_tensor_grad: Optional[torch.Tensor],
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Shape,
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """All four messages of a steady-state step in one exchange.

        Returns ``(input_tensor, output_tensor_grad)``.
        """
        return self._communicate(
            tensor_send_next=output_tensor,
            tensor_send_prev=input_tensor_grad,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
        )

    # ------------------------------------------------------------------------ exchange

    def _communicate(
        self,
        *,
        tensor_send_next: Optional[torch.Tensor],
        tensor_send_prev: Optional[torch.Tensor],
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Optional[Shape],
        wait_on_reqs: bool = True,
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """One exchange with the neighbours; returns ``(recv_from_prev, recv_from_next)``.

        Operations are posted sends first (next, then prev), then receives (from prev, then
        from next): forward messages before backward ones, each with its own tag.
        """
        if self.config.variable_seq_lengths:  # also a bare send: its receiver waits for the shape
            shape_prev, shape_next = self._communicate_shapes(
                tensor_send_next, tensor_send_prev, recv_prev, recv_next
            )
        else:
            shape_prev = shape_next = tensor_shape
        recv_from_prev = self._empty(shape_prev) if recv_prev else None
        recv_from_next = self._empty(shape_next) if recv_next else None
        ops = _ops(
            self.pp_group,
            (tensor_send_next, self.next_rank, _TAG_FORWARD, True),
            (tensor_send_prev, self.prev_rank, _TAG_BACKWARD, True),
            (recv_from_prev, self.prev_rank, _TAG_FORWARD, False),
            (recv_from_next, self.next_rank, _TAG_BACKWARD, False),
        )
        self._run(ops)
        return recv_from_prev, recv_from_next

    def _communicate_shapes(self, send_next, send_prev, recv_prev, recv_next):
        """Exchange the shapes of the tensors about to travel (``variable_seq_lengths``)."""
        device = self.device

        def shape_of(t):
            return None if t is None else torch.tensor(t.shape, dtype=torch.int64, device=device)

        buf_prev = torch.empty(3, dtype=torch.int64, device=device) if recv_prev else None
        buf_next = torch.empty(3, dtype=torch.int64, device=device) if recv_next else None
        ops = _ops(
            self.pp_group,
            (shape_of(send_next), self.next_rank, _TAG_FORWARD_SHAPE, True),
            (buf_prev, self.prev_rank, _TAG_FORWARD_SHAPE, False),
            (shape_of(send_prev), self.prev_rank, _TAG_BACKWARD_SHAPE, True),
            (buf_next, self.next_rank, _TAG_BACKWARD_SHAPE, False),
        )
        self._run(ops)
        as_shape = lambda b: None if b is None else [int(x) for x in b.tolist()]  # noqa: E731
        return as_shape(buf_prev), as_shape(buf_next)

    def _run(self, ops: List[dist.P2POp]) -> None:
        """Post ``ops`` (batched, or one by one: even stages send first, odd stages receive
        first) and wait for all of them."""
        run_p2p(
            ops,
            batched=self.config.batch_p2p_comm,
            sends_first=self.pp_rank % 2 == 0,
            synchronize=self.config.batch_p2p_sync,
        )

    def _empty(self, shape: Optional[Shape]) -> torch.Tensor:
        """A receive buffer of ``shape`` in ``pipeline_dtype`` on the backend's device."""
        if shape is None:
            raise ValueError("P2PCommunicator: a tensor_shape is required to receive a tensor")
        if self.config.pipeline_dtype is None:
            raise ValueError(
                "config.pipeline_dtype is None; set it (e.g. torch.float32) when "
                "pipeline_model_parallel_size > 1"
            )
        return torch.empty(
            tuple(shape),
            dtype=self.config.pipeline_dtype,
            device=self.device,
            requires_grad=True,
        )

    def _recv_prev(self, shape, is_first_stage):
        """Receive from the previous stage unless this is the first one."""
        if is_first_stage:
            return None
        return self._communicate(
            tensor_send_next=None,
            tensor_send_prev=None,
            recv_prev=True,
            recv_next=False,
            tensor_shape=shape,
        )[0]

    def _recv_next(self, shape, is_last_stage):
        """Receive from the next stage unless this is the last one."""
        if is_last_stage:
            return None
        return self._communicate(
            tensor_send_next=None,
            tensor_send_prev=None,
            recv_prev=False,
            recv_next=True,
            tensor_shape=shape,
        )[1]

    @staticmethod
    def _each(tensor_shapes, tensors, fn):
        """Apply ``fn(shape, tensor)`` per shape; a single shape gives a single result."""
        if _is_shape_list(tensor_shapes):
            tensors = _as_list(tensors) if tensors is not None else [None] * len(tensor_shapes)
            return [fn(shape, t) for shape, t in zip(tensor_shapes, tensors)]
        tensor = tensors[0] if isinstance(tensors, (list, tuple)) else tensors
        return fn(tensor_shapes, tensor)


def _ops(group: dist.ProcessGroup, *entries) -> List[dist.P2POp]:
    """P2POps over ``group`` for ``(tensor, peer, tag, is_send)`` entries with a tensor."""
    return [
        p2p_op(tensor, peer, group, tag, is_send=is_send)
        for tensor, peer, tag, is_send in entries
        if tensor is not None
    ]


def _as_list(tensors) -> list:
    """``tensors`` as a list (a single tensor becomes a one-element list)."""
    return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]


def _is_shape_list(shapes) -> bool:
    """True for a list of shapes, False for one shape (a sequence of ints)."""
    if not isinstance(shapes, list):
        return False
    for shape in shapes:  # a loop, not any(<generator>): this runs for every message
        if shape is None or isinstance(shape, (list, tuple, torch.Size)):
            return True
    return False


def _reject_overlap(overlap_p2p_comm: bool) -> None:
    """Asynchronous p2p overlap is not implemented: fail loudly instead of ignoring it."""
    if overlap_p2p_comm:
        raise NotImplementedError("overlap_p2p_comm=True is not supported by this core")


__all__: Sequence[str] = ["P2PCommunicator"]
