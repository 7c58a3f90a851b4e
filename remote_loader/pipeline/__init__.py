"""The streaming side: ``RemoteDataset`` (``dataset.py``), the chain a user builds, and how it
follows a new upload of its prefix (``overwrite.py``), over folders that each do one thing,
each importing only from those below it:

``run/`` the DataLoaders a pipeline runs in; ``device/`` the GPU stage in the training process;
``sources/`` where a worker's samples come from; ``state/`` what makes a pass resumable;
``stages/`` what a sample passes in a worker; ``order/`` which samples each rank and worker
reads, and in what order (pure, on integers)."""
