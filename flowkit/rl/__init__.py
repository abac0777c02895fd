"""RL math on plain tensors: token rewards, advantages, policy losses, rejection sampling."""
