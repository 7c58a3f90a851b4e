"""What makes a pass resumable: each worker's stream, the epochs and uploads in shared memory, resume/."""
