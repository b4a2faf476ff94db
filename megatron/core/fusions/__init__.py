"""Fused versions of the elementwise parts of a layer, as megatron-core switches them on with
its config fields (megatron-core uses Transformer Engine or apex kernels; here they are
``torch.compile``d functions, ``megatron.core.jit.jit_fuser``, computing the same math as the
unfused code, so gradients agree within the dtype's rounding):

| config field | function |
| --- | --- |
| ``bias_activation_fusion`` | ``fused_bias_swiglu.bias_swiglu_impl``, ``fused_bias_gelu`` |
| ``bias_dropout_fusion`` | ``fused_bias_dropout.get_bias_dropout_add(training, fused=True)`` |
| ``apply_rope_fusion`` | ``fused_rope.fused_apply_rotary_pos_emb`` |
| ``persist_layer_norm`` | ``fused_layer_norm.FusedRMSNorm`` / ``FusedLayerNorm`` |
| ``cross_entropy_loss_fusion`` | ``fused_cross_entropy.fused_vocab_parallel_cross_entropy`` |
"""
