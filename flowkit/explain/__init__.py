"""Explanation rewards (seed 000, "TPL"): a rectified flow over decision logits, read through flow tokens
that attend to a frozen LLM's last layer, scores how well an explanation lets a third party infer the
agent's hidden decision; its per-sentence rewards train the explanation LLM with PPO."""
