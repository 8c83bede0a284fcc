"""Bundle format: the safetensors layout of a stored chunk, its header, tensor names and kept positions.

Imports no quantizer: readers of the format need only torch and safetensors.
"""
