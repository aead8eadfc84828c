"""Routing traces and expert-use profiles: recording, replay against policies, statistics, synthetic traces. No MLX."""
