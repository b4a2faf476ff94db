"""The shared expert of a MoE layer: a dense MLP every token goes through, optionally scaled
by a sigmoid gate (megatron-core 0.16.1's ``SharedExpertMLP``)."""

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.parallel_groups import tp_group_of
from megatron.core.transformer.transformer_config import TransformerConfig


class SharedExpertMLP(MLP):
    """y = MLP(x) with ffn ``moe_shared_expert_intermediate_size`` (tensor-parallel over the
    model's TP group, like the dense MLP), times sigmoid(x . g) with ``gate``
    (``gate_weight`` g [1, h], replicated over TP: under sequence parallelism it is marked
    ``sequence_parallel`` by the model and its gradient summed over TP)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        gate: bool,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(
            config,
            submodules,
            ffn_hidden_size=config.moe_shared_expert_intermediate_size,
            tp_group=tp_group_of(pg_collection, config),
        )
        self.use_shared_expert_gate = gate
        if gate:
            self.gate_weight = torch.nn.Parameter(
                torch.empty(1, config.hidden_size, dtype=config.params_dtype)
            )
            if config.perform_initialization:
                with torch.no_grad():
                    config.init_method(self.gate_weight)
        else:
            self.gate_weight = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [s, b, h] (the fc2 bias, if any, added)."""
        output, bias = super().forward(hidden_states)
        if bias is not None:
            output = output + bias
        if self.use_shared_expert_gate:
            gate = torch.sigmoid(F.linear(hidden_states, self.gate_weight))
            output = output * gate
        return output
