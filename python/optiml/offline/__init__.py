"""Level 5: the work done once per model, before it runs: profile (how often each FFN neuron fires),
calibrate (sparsity thresholds), predictors (training the activation predictors), hardware (this machine's
measured speeds), solve (which neurons go to the GPU), coverage (the figure of the activation curves)."""
