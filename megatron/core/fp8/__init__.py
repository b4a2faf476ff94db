"""FP8 training whose result does not depend on the parallel layout (SPEC section 23).

``config``: megatron-core 0.16.1's ``fp8*`` fields, honoured or refused by name.
``scaling``: tensorwise current scaling from the GLOBAL amax (a MAX all-reduce over every
group a tensor is sharded across), the casts and the scaled GEMM. ``linear``: the FP8
autograd function of the column- and row-parallel linears; ``grouped``: the experts' FP8
GEMMs; ``cache``: a step's FP8 weights kept across its microbatches (``is_first_microbatch``).
"""
