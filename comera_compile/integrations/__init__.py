"""Rank-adaptive training inside the training loops people already use."""
