"""Level 5: how good a model is: perplexity (llama.cpp's convention) and the KL divergence from a base."""
