"""The engine under every analysis: the forward pass (:mod:`~actlake.analysis.engine.forward`) and its batch types
(:mod:`~actlake.analysis.engine.batch`), the interventions' edits and resumed passes, hooks on the model's attention
and hidden states, the per-layer inputs (:class:`~actlake.analysis.engine.layer_qk.LayerQK`), the products of the
attention weights computed once per layer, the Triton kernels, layer replay, surprisal from the LM head, the
self-check and device helpers. It imports no analysis:
the analyses (one module each, beside this folder) read what it produces."""
