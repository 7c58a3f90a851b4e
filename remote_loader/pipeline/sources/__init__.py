"""Where a worker's samples come from: an indexed dataset's shards, or plain tars."""
