"""Quantized-weight linear methods, one subpackage per checkpoint format.

Each subpackage provides a `QuantConfig` (see `paphos.layers.linear`) that the model builder hands
to the model; the config gives every linear layer its `LinearMethod` by module path.
"""
