"""Measuring without a model or a GPU: the model-free serving simulation and the kernels' compile report."""
