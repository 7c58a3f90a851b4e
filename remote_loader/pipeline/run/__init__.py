"""The DataLoaders a pipeline runs in: ``loader()``, its stateful variant and what runs before the fork."""
