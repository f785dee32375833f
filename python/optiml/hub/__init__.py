"""Level 3: where model files come from.

registry: the known models (models/manifest.json), the model cache, `pull` and `resolve` of a model
argument. huggingface: GGUF files from the Hugging Face Hub (org/repo:QUANT), kept in its shared cache.
checksum: the sha256 check both apply to what they fetch.
"""
