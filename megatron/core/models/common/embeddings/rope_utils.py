"""megatron-core's path for the rotary position embedding maths, which live in
``megatron.core.rope`` (below the transformer layers that apply them)."""

from megatron.core.rope import apply_rotary_pos_emb, fused_rotate, rotate

__all__ = ["apply_rotary_pos_emb", "fused_rotate", "rotate"]
