"""The Megatron-core backend: training (TP/PP/DP, elastic) and log-prob inference."""
