"""Level 2: the files OptiML reads and writes, and nothing that runs a model.

gguf: the GGUF reader. gguf_edit: a GGUF rewritten with metadata set and tensors transformed. quant: the
quantization types and their kernels. stats: the activation statistics file of `optiml profile`.
placement: a placement written into a GGUF and read back. predictors: the companion predictor GGUF.
"""
