"""Which samples each rank and worker reads in an epoch, and in what order: pure, on integers."""
