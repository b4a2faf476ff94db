"""megatron.core.datasets: megatron's indexed token format and the GPT/blended datasets.

Same module paths, names and signatures as megatron-core 0.16.1; the index helpers are numpy
(no compiled extension), see ``utils.compile_helpers``.
"""
