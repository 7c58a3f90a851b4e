"""The streaming side: which samples each rank and worker reads, and the stages they pass."""
